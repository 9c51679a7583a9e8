"""The meta service's records: a rank's window, write and read leases, counters.

Plain data shared by :class:`~kvfabric.pool.service.meta.MetaService`, the write fence
(``fence.py``) and the metrics; only the meta service mutates them (one caller at a time).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfabric.platform.types import Medium
from kvfabric.pool.service.allocator import ExtentAllocator


@dataclass
class Window:
    """One rank's contribution of one medium."""

    rank: int
    medium: Medium
    size: int
    alloc: ExtentAllocator
    lo: int  # gva of offset 0
    evictions: int = 0

    @property
    def hi(self) -> int:
        return self.lo + self.size


@dataclass
class WriteLease:
    client: str
    gva: int
    size: int
    gen: int
    expires: float
    pid: int = 0  # the writer's process when it is on this node (0: unknown, e.g. over TCP)
    extra: tuple[int, ...] = ()  # the gvas of the object's further extents (replicas.py)


@dataclass
class ReadLease:
    key: bytes
    gva: int
    gen: int
    expires: float
    extra: tuple[int, ...] = ()  # the object's further extents, held as well


@dataclass
class Counters:
    ops: dict[str, int] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    evicted_objects: int = 0
    evicted_bytes: int = 0
    expired_leases: int = 0
    fences: int = 0  # extents fenced because their write lease expired before the commit
    under_replicated: int = 0  # objects placed on fewer ranks than the replicas asked for
    promoted: int = 0  # objects whose primary extent left with its rank and a replica took over
    replicas_lost: int = 0  # extents of objects that stayed readable, gone with their rank

    def count(self, op: str, n: int = 1, failed: int = 0) -> None:
        self.ops[op] = self.ops.get(op, 0) + n
        if failed:
            self.failures[op] = self.failures.get(op, 0) + failed
