"""The meta service's upkeep: LRU eviction between watermarks, lease and TTL expiry.

A mixin of :class:`~kvfabric.pool.meta.MetaService` (it uses the service's table,
windows, leases and counters), with the record types they share. Same threading rule as
the service: one caller at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvfabric.platform.types import Medium
from kvfabric.pool.allocator import ExtentAllocator
from kvfabric.pool.table import SlotState, ticks_passed

if TYPE_CHECKING:
    from kvfabric.pool.config import PoolConfig
    from kvfabric.pool.fence import WriteFence
    from kvfabric.pool.table_writer import TableWriter


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


@dataclass
class ReadLease:
    key: bytes
    gva: int
    gen: int
    expires: float


@dataclass
class Counters:
    ops: dict[str, int] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    evicted_objects: int = 0
    evicted_bytes: int = 0
    expired_leases: int = 0
    fences: int = 0  # extents fenced because their write lease expired before the commit

    def count(self, op: str, n: int = 1, failed: int = 0) -> None:
        self.ops[op] = self.ops.get(op, 0) + n
        if failed:
            self.failures[op] = self.failures.get(op, 0) + failed


class Upkeep:
    """Eviction and expiry (see module docstring)."""

    config: PoolConfig
    table: TableWriter
    windows: dict[tuple[int, Medium], Window]
    write_leases: dict[bytes, WriteLease]
    read_leases: dict[int, ReadLease]
    _leased: dict[int, int]
    counters: Counters
    fence: WriteFence

    # ------------------------------------------------------------------ eviction
    def _evict(self, w: Window, need: int) -> bool:
        """Evict LRU objects of ``w`` until ``need`` bytes fit or nothing is evictable."""
        s = self.table.slots
        idx = self._slots_in(w)
        idx = idx[s["state"][idx] == SlotState.READABLE]
        if self._leased:
            leased = np.fromiter(self._leased, np.uint64, len(self._leased))
            idx = idx[~np.isin(s["gva"][idx], leased)]
        order = idx[np.argsort(s["atime"][idx], kind="stable")]
        target = int(w.size * self.config.low_watermark)
        for slot_i in order.tolist():
            if w.alloc.largest_free >= w.alloc.round(need) and w.alloc.used <= target:
                break
            key = self.table.view.key_of(slot_i)
            hit = self.table.find(key)
            if hit is None:
                continue
            self._free_object(hit.slot, key, hit.gva, hit.size)
            w.evictions += 1
            self.counters.evicted_objects += 1
            self.counters.evicted_bytes += hit.size
        return w.alloc.largest_free >= w.alloc.round(need)

    def _watermark(self, w: Window) -> None:
        if w.alloc.used > w.size * self.config.high_watermark:
            self._evict(w, need=1)

    # ------------------------------------------------------------------ housekeeping
    def tick(self) -> None:
        """Expire write leases (space reclaimed), read leases and TTLs."""
        now = self.clock()
        expired = []
        for key in [k for k, lease in self.write_leases.items() if lease.expires < now]:
            lease = self.write_leases.pop(key)
            hit = self.table.find(key)
            if hit is not None and hit.gen == lease.gen and hit.state == SlotState.ALLOCATED:
                expired.append((key, lease))
            self.counters.expired_leases += 1
        if expired:
            self.fence.close(expired, now)
        self.fence.sweep(now)
        for lid in [i for i, lease in self.read_leases.items() if lease.expires < now]:
            self._end_read_lease(lid)
            self.counters.expired_leases += 1
        s = self.table.slots
        exp = np.flatnonzero((s["hash"] != 0) & (s["expire"] != 0))
        for slot_i in exp.tolist():
            if ticks_passed(int(s["expire"][slot_i])):
                key = self.table.view.key_of(slot_i)
                hit = self.table.find(key)
                if hit is not None:
                    self._free_object(hit.slot, key, hit.gva, hit.size)
