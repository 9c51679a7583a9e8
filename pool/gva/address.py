"""Global virtual addresses: one integer names the same byte in every process of a pool.

::

    gva = base[medium] + rank * stride[medium] + offset        0 <= offset < window(rank, medium)

Each medium owns a region of ``2**60`` numbers: DRAM windows live in
``[1 << 60, 2 << 60)``, HBM windows in ``[2 << 60, 3 << 60)``. Every integer below
:data:`GVA_FLOOR` is therefore *not* a GVA, which is what lets a copy descriptor carry
local addresses (pointers into this process's buffers, always below ``2**57`` on the
CPUs and accelerators we run on) and GVAs side by side in one ``uint64`` array.

``stride[medium]`` is the same for every rank: the largest window any rank contributes,
rounded up to a power of two (``AddressSpace.stride_for``), never a rank's own size.
Nothing is reserved: a GVA is a number, mapped to memory by the segment table.

Everything here is pure: :func:`encode` / :func:`decode` invert each other (property
tested), ``decode_many`` is their vectorised form for batches. Bad input raises
``ValueError`` naming the address.

This module is the only place that knows the bit layout; every other module goes
through the functions below:

- :func:`encode` / :func:`decode` / :func:`decode_many`: checked, against an
  :class:`AddressSpace` (medium, rank, offset);
- :func:`pack` / :func:`unpack` / :func:`region_of`: the raw arithmetic for one stride
  (region number, rank, offset), unchecked, for hot paths that have validated already
  and for addressings with a fixed stride (``kvfabric.pool.windows``);
- window keys, which group the items of a copy batch by window: ``window_key(region,
  rank) = region << RANK_BITS | rank`` (:data:`LOCAL_KEY`, 0, is plain local memory),
  :func:`window_keys` for rank arrays, :func:`key_region` / :func:`key_rank` to take one
  apart, and :func:`pair_keys` for a (source, destination) pair of keys in one int64.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, NewType

import numpy as np

from kvfabric.platform.types import Medium

Gva = NewType("Gva", int)

REGION_BITS: Final = 60
REGION_SIZE: Final = 1 << REGION_BITS
GVA_FLOOR: Final = REGION_SIZE  # every int >= this is a GVA, every int below is a local address
MEDIUM_REGION: dict[Medium, int] = {Medium.DRAM: 1, Medium.HBM: 2}
REGION_MEDIUM: dict[int, Medium] = {v: k for k, v in MEDIUM_REGION.items()}
GVA_END: Final = (max(REGION_MEDIUM) + 1) << REGION_BITS
MIN_STRIDE: Final = 1 << 21  # 2 MiB: windows are laid out at least huge-page apart
_MASK = REGION_SIZE - 1

RANK_BITS: Final = 24  # a window key holds the rank in its low RANK_BITS bits, the region above
MAX_RANKS: Final = 1 << RANK_BITS  # ranks are numbered below this
KEY_BITS: Final = RANK_BITS + 2  # every window key (region <= 3) is below 1 << KEY_BITS
LOCAL_KEY: Final = 0  # window key of plain local memory (not a GVA)
_RANK_MASK = MAX_RANKS - 1


def base(medium: Medium) -> int:
    """The first GVA of ``medium``'s region."""
    return MEDIUM_REGION[medium] << REGION_BITS


def is_gva(value: int) -> bool:
    """True for integers in a GVA region (local addresses are all below :data:`GVA_FLOOR`)."""
    return GVA_FLOOR <= value < GVA_END


def region_of(addr: int) -> int:
    """The region number of ``addr``: 1 (DRAM), 2 (HBM), 0 for a local address (any int
    below :data:`GVA_FLOOR`); other values are in no region."""
    return addr >> REGION_BITS


def pack(region: int, rank: int, offset: int, stride: int) -> int:
    """``(region << REGION_BITS) + rank * stride + offset``, unchecked: the caller keeps
    ``0 <= offset < stride`` and ``0 <= rank < REGION_SIZE // stride`` (see :func:`encode`
    for the checked form). ``offset`` 0 gives the first address of ``rank``'s window."""
    return (region << REGION_BITS) + rank * stride + offset


def unpack(addr: int, stride: int) -> tuple[int, int, int]:
    """``(region, rank, offset)`` of ``addr`` at ``stride``, unchecked: the inverse of
    :func:`pack` (see :func:`decode` for the checked form, :func:`decode_many` for arrays)."""
    rank, offset = divmod(addr & _MASK, stride)
    return addr >> REGION_BITS, rank, offset


def window_key(region: int, rank: int) -> int:
    """The group key of ``rank``'s window in ``region``: region in the high bits, rank in
    the low :data:`RANK_BITS` (``0 <= rank <`` :data:`MAX_RANKS`, unchecked)."""
    return (region << RANK_BITS) | rank


def window_keys(region: int, ranks: np.ndarray) -> np.ndarray:
    """Vectorised :func:`window_key` of an int64 rank array (one region): int64 keys."""
    return (region << RANK_BITS) | ranks


def key_region(key: int) -> int:
    """The region of a window key (0 for :data:`LOCAL_KEY`); an int64 key array works too."""
    return key >> RANK_BITS


def key_rank(key: int) -> int:
    """The rank of a window key (0 for :data:`LOCAL_KEY`, which belongs to no rank); an
    int64 key array works too."""
    return key & _RANK_MASK


def pair_keys(src_keys: np.ndarray, dst_keys: np.ndarray) -> np.ndarray:
    """One int64 per ``(source key, destination key)`` pair, equal iff both keys are."""
    return (src_keys << KEY_BITS) | dst_keys


def _pow2_at_least(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


@dataclass(frozen=True)
class AddressSpace:
    """Per-medium strides of one pool (``0``: no window of that medium yet).

    ``max_ranks(medium)`` follows from the stride: ``REGION_SIZE // stride``.
    """

    dram_stride: int = 0
    hbm_stride: int = 0

    def __post_init__(self) -> None:
        for name in ("dram_stride", "hbm_stride"):
            s = getattr(self, name)
            if isinstance(s, bool) or not isinstance(s, int):
                raise TypeError(f"AddressSpace.{name} must be an int, got {type(s).__name__}")
            if s and (s < MIN_STRIDE or s & (s - 1) or s > REGION_SIZE):
                raise ValueError(
                    f"AddressSpace.{name} must be 0 or a power of two in [{MIN_STRIDE}, 2**60], got {s}"
                )

    def stride(self, medium: Medium) -> int:
        return self.dram_stride if medium is Medium.DRAM else self.hbm_stride

    def max_ranks(self, medium: Medium) -> int:
        s = self.stride(medium)
        return REGION_SIZE // s if s else 0

    @staticmethod
    def stride_for(window_bytes: int) -> int:
        """The stride a window of ``window_bytes`` needs: a power of two >= 2 MiB."""
        if window_bytes <= 0:
            raise ValueError(f"window size must be > 0, got {window_bytes}")
        if window_bytes > REGION_SIZE:
            raise ValueError(f"window of {window_bytes} B exceeds the 2**60 B region of a medium")
        return max(MIN_STRIDE, _pow2_at_least(window_bytes))

    def widened(self, medium: Medium, window_bytes: int) -> AddressSpace:
        """This space with ``medium``'s stride raised (never lowered) to fit ``window_bytes``."""
        need = self.stride_for(window_bytes)
        if need <= self.stride(medium):
            return self
        if medium is Medium.DRAM:
            return AddressSpace(need, self.hbm_stride)
        return AddressSpace(self.dram_stride, need)


def encode(space: AddressSpace, medium: Medium, rank: int, offset: int) -> Gva:
    """The GVA of byte ``offset`` of ``rank``'s ``medium`` window."""
    stride = space.stride(medium)
    if not stride:
        raise ValueError(f"no {medium.value} window exists in this address space (stride 0)")
    if (
        isinstance(rank, bool)
        or not isinstance(rank, (int, np.integer))
        or not 0 <= rank < REGION_SIZE // stride
    ):
        raise ValueError(f"rank {rank!r} is outside [0, {REGION_SIZE // stride}) for {medium.value}")
    if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)) or not 0 <= offset < stride:
        raise ValueError(f"offset {offset!r} is outside the {medium.value} stride [0, {stride})")
    return Gva(pack(MEDIUM_REGION[medium], int(rank), int(offset), stride))


def decode(space: AddressSpace, gva: int) -> tuple[Medium, int, int]:
    """``(medium, rank, offset)`` of ``gva``; ``ValueError`` if it is in no region."""
    if isinstance(gva, bool) or not isinstance(gva, (int, np.integer)):
        raise TypeError(f"a GVA is an int, got {type(gva).__name__}")
    g = int(gva)
    medium = REGION_MEDIUM.get(region_of(g))
    if medium is None:
        raise ValueError(
            f"{g:#x} is not a global virtual address (GVAs lie in [{GVA_FLOOR:#x}, {GVA_END:#x}))"
        )
    stride = space.stride(medium)
    if not stride:
        raise ValueError(f"{g:#x} is in the {medium.value} region, which has no window")
    _region, rank, offset = unpack(g, stride)
    return medium, rank, offset


def decode_many(space: AddressSpace, gvas: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Vectorised :func:`decode` of a uint64 array: ``(region, rank, offset)`` arrays.

    ``region`` is 1 (DRAM) or 2 (HBM), 0 where the value is not a GVA (a local address;
    its rank and offset are 0 and the value itself)."""
    g = np.asarray(gvas, dtype=np.uint64)
    region = (g >> np.uint64(REGION_BITS)).astype(np.int64)
    region[region > max(REGION_MEDIUM)] = -1
    local = region == 0
    strides = np.array([1, space.dram_stride or 1, space.hbm_stride or 1], np.uint64)
    st = strides[np.where(region > 0, region, 0)]
    low = g & np.uint64(_MASK)
    rank = (low // st).astype(np.int64)
    offset = low % st
    rank[local] = 0
    offset = np.where(local, g, offset)
    return region, rank, offset


__all__ = [
    "GVA_END",
    "GVA_FLOOR",
    "KEY_BITS",
    "LOCAL_KEY",
    "MAX_RANKS",
    "MEDIUM_REGION",
    "MIN_STRIDE",
    "RANK_BITS",
    "REGION_BITS",
    "REGION_MEDIUM",
    "REGION_SIZE",
    "AddressSpace",
    "Gva",
    "base",
    "decode",
    "decode_many",
    "encode",
    "is_gva",
    "key_rank",
    "key_region",
    "pack",
    "pair_keys",
    "region_of",
    "unpack",
    "window_key",
    "window_keys",
]
