"""What the pool needs from the address space: GVA <-> (medium, rank, offset)."""

from __future__ import annotations

from typing import Protocol

from kvfabric.platform.types import Medium


class Addressing(Protocol):
    """Pure, identical in every process (see ``kvfabric.pool.gva``)."""

    def encode(self, medium: Medium, rank: int, offset: int) -> int: ...

    def decode(self, gva: int) -> tuple[Medium, int, int]: ...


_REGION_BITS = 60
_REGION = {Medium.DRAM: 1, Medium.HBM: 2}
_MEDIUM = {v: k for k, v in _REGION.items()}


class FixedStride:
    """The pool's addressing: ``gva = base[medium] + rank * stride + offset`` with one
    stride fixed for the pool's life (so a GVA in the directory never changes meaning
    when a bigger window joins). ``base[DRAM] = 1 << 60``, ``base[HBM] = 2 << 60``."""

    def __init__(self, stride: int = 1 << 40) -> None:
        if stride <= 0 or stride & (stride - 1):
            raise ValueError(f"stride must be a power of two, got {stride}")
        self.stride = stride

    def encode(self, medium: Medium, rank: int, offset: int) -> int:
        if not 0 <= rank < (1 << _REGION_BITS) // self.stride:
            raise ValueError(f"rank {rank} out of range for stride {self.stride}")
        if not 0 <= offset < self.stride:
            raise ValueError(f"offset {offset} is outside a {self.stride} B stride")
        return (_REGION[medium] << _REGION_BITS) + rank * self.stride + offset

    def decode(self, gva: int) -> tuple[Medium, int, int]:
        medium = _MEDIUM.get(gva >> _REGION_BITS)
        if medium is None:
            raise ValueError(f"{gva:#x} is not a global virtual address")
        rel = gva & ((1 << _REGION_BITS) - 1)
        return medium, rel // self.stride, rel % self.stride
