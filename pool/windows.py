"""What the pool needs from the address space: GVA <-> (medium, rank, offset)."""

from __future__ import annotations

from typing import Protocol

from kvfabric.platform.types import Medium


class Addressing(Protocol):
    """Pure, identical in every process (see ``kvfabric.pool.gva``)."""

    def encode(self, medium: Medium, rank: int, offset: int) -> int: ...

    def decode(self, gva: int) -> tuple[Medium, int, int]: ...
