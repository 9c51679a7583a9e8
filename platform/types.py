"""Value types of the platform contract: media, copy directions, spans and copy batches.

Everything here is immutable and cheap; nothing touches a device runtime.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

import numpy as np

if TYPE_CHECKING:
    from kvfabric.platform.buffer import Buffer


class Medium(enum.Enum):
    """Where a buffer's bytes live."""

    DRAM = "dram"  # host memory
    HBM = "hbm"  # device memory (on the sim platform: host memory playing the device)

    @classmethod
    def parse(cls, value: Medium | str) -> Medium:
        if isinstance(value, Medium):
            return value
        if isinstance(value, str):
            try:
                return cls(value.strip().lower())
            except ValueError:
                pass
        raise ValueError(f"unknown medium {value!r}: expected 'dram' or 'hbm'")


class Direction(enum.IntEnum):
    """Copy direction; the values are the memcpy kinds CUDA and ACL both use."""

    H2H = 0
    H2D = 1
    D2H = 2
    D2D = 3

    @classmethod
    def of(cls, dst: Medium, src: Medium) -> Direction:
        if src is Medium.DRAM:
            return cls.H2H if dst is Medium.DRAM else cls.H2D
        return cls.D2H if dst is Medium.DRAM else cls.D2D


class BufferKind(enum.Enum):
    """Who owns a buffer's memory, and so what ``Platform.free`` does with it."""

    OWNED = "owned"  # allocated by this platform: free releases the memory
    IMPORTED = "imported"  # mapped from another process's handle: free unmaps it
    REGISTERED = "registered"  # caller's memory pinned for DMA: free unpins it
    WRAPPED = "wrapped"  # caller's memory made addressable, not pinned: free forgets it


@dataclass(frozen=True)
class Span:
    """``nbytes`` bytes of ``buffer`` starting at ``offset``; what copies address."""

    buffer: Buffer
    offset: int
    nbytes: int

    @property
    def ptr(self) -> int:
        return self.buffer.ptr + self.offset

    @property
    def medium(self) -> Medium:
        return self.buffer.medium


Endpoint = Union["Buffer", Span]


@dataclass(frozen=True)
class CopyBatch:
    """Many ``(dst, src, nbytes)`` pieces as three equal-length uint64 arrays of addresses.

    Building one is O(1) Python work when the arrays already exist (the Delegator and the
    stores keep address matrices), which is why batched copies take addresses, not spans.
    """

    dst: np.ndarray
    src: np.ndarray
    nbytes: np.ndarray

    def __post_init__(self) -> None:
        arrays = []
        for name in ("dst", "src", "nbytes"):
            a = np.ascontiguousarray(getattr(self, name))
            if a.ndim != 1:
                raise ValueError(f"CopyBatch.{name} must be 1-D, got shape {a.shape}")
            if a.dtype != np.uint64:
                if a.size and (a.dtype.kind not in "iu" or int(a.min()) < 0):
                    raise ValueError(f"CopyBatch.{name} must hold non-negative integers, got {a.dtype}")
                a = a.astype(np.uint64)
            arrays.append(a)
            object.__setattr__(self, name, a)
        if not (arrays[0].shape == arrays[1].shape == arrays[2].shape):
            raise ValueError(
                "CopyBatch arrays differ in length: "
                f"dst {arrays[0].size}, src {arrays[1].size}, nbytes {arrays[2].size}"
            )

    def __len__(self) -> int:
        return int(self.dst.size)

    @functools.cached_property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum())

    @classmethod
    def from_items(cls, items: Iterable[tuple[Endpoint | int, Endpoint | int, int]]) -> CopyBatch:
        """Build a batch from ``(dst, src, nbytes)`` tuples of buffers, spans or addresses."""
        dst, src, sizes = [], [], []
        for i, item in enumerate(items):
            try:
                d, s, n = item
            except (TypeError, ValueError):
                raise TypeError(f"copy item {i} must be a (dst, src, nbytes) tuple, got {item!r}") from None
            dst.append(_address(d, i, "dst"))
            src.append(_address(s, i, "src"))
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
                raise TypeError(f"copy item {i}: nbytes must be an int, got {n!r}")
            if n <= 0:
                raise ValueError(f"copy item {i}: nbytes must be > 0, got {n}")
            sizes.append(int(n))
        return cls(np.array(dst, np.uint64), np.array(src, np.uint64), np.array(sizes, np.uint64))


def _address(end: object, i: int, which: str) -> int:
    if isinstance(end, (int, np.integer)) and not isinstance(end, bool):
        return int(end)
    ptr = getattr(end, "ptr", None)
    if isinstance(ptr, int):
        return ptr
    raise TypeError(f"copy item {i}: {which} must be a Buffer, Span or address, got {type(end).__name__}")


@dataclass(frozen=True)
class DeviceInfo:
    """One device as a platform reports it."""

    index: int
    name: str
    total_bytes: int | None
    free_bytes: int | None


@dataclass(frozen=True)
class PlatformInfo:
    """What ``kvfabric info`` prints about a platform."""

    name: str
    runtime: str
    devices: tuple[DeviceInfo, ...]
    supports_ipc: bool
    supports_batch_copy: bool
