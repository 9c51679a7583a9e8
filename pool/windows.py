"""What the pool needs from the address space: GVA <-> (medium, rank, offset)."""

from __future__ import annotations

from typing import Protocol

from kvfabric.platform.types import Medium
from kvfabric.pool.gva.address import MEDIUM_REGION, REGION_MEDIUM, REGION_SIZE, pack, region_of, unpack


class Addressing(Protocol):
    """Pure, identical in every process (see ``kvfabric.pool.gva``)."""

    def encode(self, medium: Medium, rank: int, offset: int) -> int: ...

    def decode(self, gva: int) -> tuple[Medium, int, int]: ...


class FixedStride:
    """The pool's addressing: ``gva = base[medium] + rank * stride + offset`` with one
    stride fixed for the pool's life (so a GVA in the directory never changes meaning
    when a bigger window joins). ``base[DRAM] = 1 << 60``, ``base[HBM] = 2 << 60``; the
    bit layout is ``kvfabric.pool.gva.address``'s (``pack`` / ``unpack``)."""

    def __init__(self, stride: int = 1 << 40) -> None:
        if stride <= 0 or stride & (stride - 1):
            raise ValueError(f"stride must be a power of two, got {stride}")
        self.stride = stride

    def encode(self, medium: Medium, rank: int, offset: int) -> int:
        if not 0 <= rank < REGION_SIZE // self.stride:
            raise ValueError(f"rank {rank} out of range for stride {self.stride}")
        if not 0 <= offset < self.stride:
            raise ValueError(f"offset {offset} is outside a {self.stride} B stride")
        return pack(MEDIUM_REGION[medium], rank, offset, self.stride)

    def decode(self, gva: int) -> tuple[Medium, int, int]:
        medium = REGION_MEDIUM.get(region_of(gva))
        if medium is None:
            raise ValueError(f"{gva:#x} is not a global virtual address")
        _region, rank, offset = unpack(gva, self.stride)
        return medium, rank, offset
