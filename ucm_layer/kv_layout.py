"""``KVLayout``: where the bytes of one KV block live, as arrays of addresses.

An inference engine keeps its paged KV cache as per-layer tensors whose shapes differ by
backend: the CPU backend's whole-block pages ``[blocks, heads, tokens, 2*head]`` (one
contiguous piece per layer per block), CUDA's ``[2, blocks, tokens, heads, head]`` (a K
and a V piece per layer per block, or one per head when the layout is head-major), the
separate K and V tensors of vLLM-Ascend (a tuple per layer), or MLA's single latent
tensor (or Ascend's ``(nope, rope)`` pair). :func:`layout_from_tensors` reduces all of
them to the same description: a block is ``m`` *pieces*; piece ``j`` of block ``b``
starts at ``base[j] + b * stride[j]`` and is ``size[j]`` bytes long. Pieces are ordered
layer by layer (``layer_slices``), so a layer-wise transfer takes a column range.

Nothing here imports torch: tensors are read through ``shape``, ``stride()``,
``element_size()`` and ``data_ptr()``. The layout only describes memory; it owns none
(the caller keeps the tensors alive and makes them addressable on its platform).

:attr:`KVLayout.signature` names what the bytes of a stored block *mean*, without
addresses, strides or the block count: per layer and tensor the dtype, how many kernel
blocks make one block, the sizes of the other dimensions, and the order the bytes run
through them (physical order). A store holds a block as its pieces
in order, so two engines whose signatures match store the same bytes for the same KV
and may share blocks; any difference (another dimension order, dtype, head count, layer
count) means they may not. :class:`TensorGeometry` lets a caller that has no tensors
(vLLM's scheduler role) describe the ones an engine will allocate and get the
signature those would have (see ``connector/compat.py``, docs/hashing.md).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

#: more contiguous runs than this in one layer's block means a layout we should not
#: move piece by piece (it would be a per-element copy): refuse it with a clear error
MAX_RUNS_PER_LAYER = 4096


@dataclass(frozen=True)
class KVLayout:
    """Pieces of one KV block (see the module docstring). Arrays are read-only."""

    layer_names: tuple[str, ...]
    num_blocks: int
    base: np.ndarray  # (m,) uint64: address of the piece for block 0
    stride: np.ndarray  # (m,) uint64: bytes between consecutive blocks
    size: np.ndarray  # (m,) uint64: bytes of the piece
    layer_slices: tuple[tuple[int, int], ...]  # per layer: [start, stop) piece columns
    description: str  # shapes, strides and dtypes (for logs and errors)
    signature: str = ""  # what a stored block's bytes mean (see the module docstring)

    def __post_init__(self) -> None:
        m = self.base.size
        if m == 0 or self.stride.size != m or self.size.size != m:
            raise ValueError("KVLayout needs equal, non-empty base/stride/size arrays")
        if self.num_blocks <= 0:
            raise ValueError(f"KVLayout.num_blocks must be > 0, got {self.num_blocks}")
        if len(self.layer_slices) != len(self.layer_names):
            raise ValueError("KVLayout needs one piece range per layer")
        for a in (self.base, self.stride, self.size):
            a.setflags(write=False)

    @property
    def pieces(self) -> int:
        return int(self.base.size)

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    @property
    def block_bytes(self) -> int:
        return int(self.size.sum())

    @property
    def piece_sizes(self) -> tuple[int, ...]:
        return tuple(int(s) for s in self.size)

    def layer_bytes(self, layer: int) -> int:
        a, b = self.layer_slices[layer]
        return int(self.size[a:b].sum())

    def uniform_layers(self) -> bool:
        """Whether every layer has the same piece sizes (required for layer-wise shards)."""
        first = self.size[slice(*self.layer_slices[0])]
        return all(np.array_equal(self.size[slice(a, b)], first) for a, b in self.layer_slices)

    def check_blocks(self, block_ids: Any) -> np.ndarray:
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.num_blocks):
            bad = ids[(ids < 0) | (ids >= self.num_blocks)][0]
            raise ValueError(f"block id {int(bad)} is outside the KV cache (0..{self.num_blocks - 1})")
        return ids

    def addrs(self, block_ids: Any, layer: int | None = None) -> np.ndarray:
        """``(n, m)`` uint64 addresses of the pieces of ``block_ids`` (one layer's columns
        when ``layer`` is given)."""
        ids = self.check_blocks(block_ids).astype(np.uint64)
        cols = slice(None) if layer is None else slice(*self.layer_slices[layer])
        return self.base[cols][None, :] + ids[:, None] * self.stride[cols][None, :]

    def fingerprint(self) -> bytes:
        """16 bytes naming the meaning of a stored block's bytes: BLAKE2b-128 of
        :attr:`signature` (independent of addresses, strides and the block count)."""
        return hashlib.blake2b(self.signature.encode(), digest_size=16, person=b"kvf-layout-v1").digest()


@dataclass(frozen=True)
class TensorGeometry:
    """Shape, strides (in elements) and dtype of a tensor that is not allocated (yet).

    Reads like a tensor to :func:`layout_from_tensors` (``data_ptr()`` is 0), so a role
    without the KV tensors gets the :attr:`KVLayout.signature` of the ones an engine
    allocates from the same shapes and strides."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int
    dtype: str

    def __post_init__(self) -> None:
        if len(self.shape) != len(self.strides) or not self.shape:
            raise ValueError(f"TensorGeometry needs a stride per dimension, got {self.shape} {self.strides}")
        if self.itemsize < 1:
            raise ValueError(f"TensorGeometry.itemsize must be >= 1, got {self.itemsize}")

    def stride(self) -> tuple[int, ...]:
        return self.strides

    def element_size(self) -> int:
        return self.itemsize

    def data_ptr(self) -> int:
        return 0


def _runs(shape: Sequence[int], strides: Sequence[int]) -> tuple[np.ndarray, int]:
    """Element offsets of the contiguous runs of a strided sub-tensor, and the run length.

    Dimensions are taken in physical order (largest stride first), size-1 dimensions
    dropped; the longest contiguous suffix forms one run, the remaining dimensions
    enumerate where each run starts."""
    dims = sorted(((int(s), int(t)) for s, t in zip(shape, strides) if s != 1), key=lambda d: -d[1])
    run = 1
    while dims and dims[-1][1] == run:
        run *= dims.pop()[0]
    offsets = np.zeros(1, np.int64)
    for size, stride in dims:
        offsets = (offsets[:, None] + np.arange(size, dtype=np.int64)[None, :] * stride).reshape(-1)
        if offsets.size > MAX_RUNS_PER_LAYER:
            raise ValueError(
                f"KV tensor of shape {tuple(shape)} strides {tuple(strides)} splits a block into more "
                f"than {MAX_RUNS_PER_LAYER} pieces; this layout is not supported"
            )
    return np.sort(offsets), run


def _block_dim(t: Any, num_blocks: int, block_stride: int | None) -> tuple[int, int]:
    """``(dim, kernel blocks per block)`` of the block dimension of tensor ``t``."""
    shape, strides, esz = tuple(t.shape), tuple(t.stride()), int(t.element_size())
    if block_stride:
        for d, (s, st) in enumerate(zip(shape, strides)):
            if s % num_blocks == 0 and st * esz * (s // num_blocks) == block_stride:
                return d, s // num_blocks
    exact = [d for d, s in enumerate(shape) if s == num_blocks]
    if exact:
        return max(exact, key=lambda d: strides[d]), 1
    split = [d for d, s in enumerate(shape) if s > num_blocks and s % num_blocks == 0]
    if split:
        d = max(split, key=lambda d: strides[d])
        return d, shape[d] // num_blocks
    raise ValueError(
        f"no dimension of the KV tensor of shape {shape} counts the {num_blocks} KV blocks "
        "(expected a dimension of size num_blocks or a multiple of it)"
    )


def _tensor_signature(shape: Sequence[int], strides: Sequence[int], dtype: str, d: int, k: int) -> str:
    """What the bytes of one block of a tensor mean: kernel blocks ``k`` per block, dtype,
    the sizes of the other dimensions in logical order (size-1 dimensions dropped, so a
    tensor with an extra unit axis reads the same), and the order the bytes run through
    them (``/``: positions in that list, largest stride first)."""
    sub = [i for i in range(len(shape)) if i != d and shape[i] != 1]
    order = sorted(range(len(sub)), key=lambda j: (-strides[sub[j]], j))
    sizes = "x".join(str(shape[i]) for i in sub) or "1"
    return f"k{k}:{dtype}:{sizes}/" + ",".join(str(j) for j in order)


def _tensor_pieces(
    t: Any, num_blocks: int, block_stride: int | None
) -> tuple[np.ndarray, int, int, str, str]:
    """``(offsets in bytes from data_ptr, piece bytes, block stride bytes, description,
    signature)``."""
    d, k = _block_dim(t, num_blocks, block_stride)
    shape, strides, esz = list(t.shape), list(t.stride()), int(t.element_size())
    kstride = strides[d]
    sub_shape = shape[:d] + shape[d + 1 :]
    sub_strides = strides[:d] + strides[d + 1 :]
    offs, run = _runs(sub_shape, sub_strides)
    if k > 1:  # one engine block spans k consecutive kernel blocks
        offs = (np.arange(k, dtype=np.int64)[:, None] * kstride + offs[None, :]).reshape(-1)
    dtype = str(getattr(t, "dtype", f"{esz}B"))
    desc = f"{tuple(shape)}/{tuple(strides)}/{dtype}/d{d}k{k}"
    return offs * esz, run * esz, kstride * k * esz, desc, _tensor_signature(shape, strides, dtype, d, k)


def _run_length(items: Sequence[str]) -> str:
    """``"4*[a] 1*[b]"`` for ``a, a, a, a, b`` (order kept)."""
    out: list[tuple[str, int]] = []
    for it in items:
        if out and out[-1][0] == it:
            out[-1] = (it, out[-1][1] + 1)
        else:
            out.append((it, 1))
    return " ".join(f"{n}*[{it}]" for it, n in out)


def layout_from_tensors(
    kv_caches: Mapping[str, Any],
    num_blocks: int,
    block_strides: Mapping[str, int] | None = None,
) -> KVLayout:
    """Describe the pieces of a block of ``kv_caches`` (layer name -> tensor, or a tuple
    / list of tensors such as vLLM-Ascend's ``(k_cache, v_cache)``).

    ``num_blocks`` is the engine's block count; ``block_strides`` (optional, per layer)
    the byte distance between blocks when the engine states it, which resolves layouts
    where another dimension has the same size as the block count."""
    if not kv_caches:
        raise ValueError("no KV cache tensors to describe")
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
        raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
    base, stride, size, slices, descs, sigs = [], [], [], [], [], []
    for name, value in kv_caches.items():
        tensors = list(value) if isinstance(value, (tuple, list)) else [value]
        if not tensors or not all(hasattr(t, "data_ptr") and hasattr(t, "stride") for t in tensors):
            raise TypeError(f"KV cache of layer {name!r} must be a tensor or a tuple of tensors")
        start = len(size)
        hint = (block_strides or {}).get(name) if len(tensors) == 1 else None
        layer_sig = []
        for t in tensors:
            offs, piece, bstride, desc, sig = _tensor_pieces(t, num_blocks, hint)
            ptr = int(t.data_ptr())
            base += [ptr + int(o) for o in offs]
            stride += [bstride] * offs.size
            size += [piece] * offs.size
            descs.append(desc)
            layer_sig.append(sig)
        slices.append((start, len(size)))
        sigs.append("+".join(layer_sig))
    return KVLayout(
        layer_names=tuple(kv_caches),
        num_blocks=num_blocks,
        base=np.array(base, np.uint64),
        stride=np.array(stride, np.uint64),
        size=np.array(size, np.uint64),
        layer_slices=tuple(slices),
        description=f"{len(kv_caches)} layers: " + ";".join(dict.fromkeys(descs)),
        signature=_run_length(sigs),
    )
