"""``WriteFence``: a write that outlives its lease never lands on another object's memory.

The hazard: ``alloc`` hands a writer space under a write lease; a writer that stalls past
the lease (SIGSTOP, a starved core, a slow remote batch) may still be copying when it
wakes. If the service simply freed the space at expiry, the allocator could hand it to a
new object that is READABLE by then, and the late copy would overwrite it. The slot
counter of the victim does not change, so readers would accept the corrupted bytes.

The design (both ends):

* **Writers** check their own deadline (alloc time + lease - margin, measured from before
  the alloc request left) before every copy and renew the lease between the chunks of a
  long copy; a writer past its deadline abandons the put instead of copying. The
  single-piece fast path copies only while its rank is still a member of the fabric.
* **The service** never frees the space of an expired lease: it *fences* it. The object's
  slot is replaced by a tombstone slot in state ``REMOVING`` (key ``FENCE_PREFIX`` + the
  generation, which no client key can equal: keys starting ``\\xff\\xfe`` are refused),
  so the key itself is free for a new put while the extent stays reserved. A fence is
  released when the writer says it is done with the key (its commit, whatever the outcome: it has stopped
  copying), when the writer's process is gone (writers on this node: the RPC server knows
  their pid), or, for writers it cannot watch (over TCP, or adopted from a previous
  service after a restart), after ``fence_grace_s`` — several lease periods.
* **Replicas**: a put of N extents is fenced whole: every extent of an expired lease (the
  replica slots under ``replicas.replica_key`` too), and, when one of its ranks leaves
  mid-put, the extents left in the other windows (``hold``); the writer's commit
  releases them all.
* **Restarts**: the new service reads the previous directory table; every extent it had
  handed out but not published (``ALLOCATED``) or had fenced (``REMOVING``) is fenced
  again for ``fence_grace_s``, in the service's own window at once and in a client's
  window when that rank rejoins.

What is left: a writer over TCP that stalls inside one copy chunk for longer than
``fence_grace_s`` (the default is six lease periods). docs/pool.md says so.

Threading: the service's (one caller at a time). The fence owns the tombstone slots and
the reserved extents; the service owns everything else.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvfabric.errors import OutOfSpace
from kvfabric.platform import shm
from kvfabric.pool.table import SlotState

if TYPE_CHECKING:
    from kvfabric.pool.service.records import Counters, Window, WriteLease
    from kvfabric.pool.service.table_writer import TableWriter

log = logging.getLogger("kvfabric.pool")

FENCE_PREFIX = b"\xff\xfefence:"  # the reserved prefix (pool.keys): never a client key


@dataclass
class Fence:
    """One fenced extent (see module docstring)."""

    client: str  # "" for an extent adopted from a previous service
    key: bytes  # the key the writer was storing
    gva: int
    size: int
    pid: int  # the writer's process on this node; 0: cannot be watched
    deadline: float  # service clock; released by time only when pid is 0
    tomb: bytes  # the tombstone slot's key ("" when the table had no room for it)


def _writer_gone(f: Fence, now: float) -> bool:
    """A writer on this node is gone with its process; one it cannot watch, after the grace."""
    if f.pid == 0:
        return f.deadline < now
    return f.pid != os.getpid() and not shm.process_alive(f.pid)


class WriteFence:
    """The service's fenced extents (see module docstring)."""

    def __init__(self, table: TableWriter, windows: dict, counters: Counters, grace_s: float) -> None:
        self.table = table
        self.windows = windows  # the service's (rank, medium) -> Window, shared
        self.counters = counters
        self.grace_s = grace_s
        self.fences: dict[int, Fence] = {}  # gva -> fence
        self._by_writer: dict[tuple[str, bytes], list[int]] = {}  # (client, key) -> gvas
        self._adopted: list[tuple[int, int, float]] = []  # (gva, size, deadline), window not here yet

    # ------------------------------------------------------------------ fencing
    def close(self, expired: list[tuple[bytes, WriteLease]], now: float) -> None:
        """Write leases expired before their commit (their slots still ALLOCATED, same
        generation): fence their space, and say so in one line per writer."""
        from kvfabric.pool.service.replicas import replica_key

        by_writer: dict[tuple[str, int], list[int]] = {}
        for key, lease in expired:
            hit = self.table.find(key)  # looked up here: each removal may move other slots
            if hit is None:
                continue
            self.table.remove(hit.slot)
            self._add(lease.client, key, lease.gva, lease.size, lease.pid, now + self.grace_s)
            for i, gva in enumerate(lease.extra, 1):  # the put's further extents, fenced alike
                rhit = self.table.find(replica_key(key, i))
                if rhit is not None:
                    self.table.remove(rhit.slot)
                self._add(lease.client, key, gva, lease.size, lease.pid, now + self.grace_s)
            by_writer.setdefault((lease.client, lease.pid), []).append(lease.size * (1 + len(lease.extra)))
        self.counters.fences += len(expired)
        for (client, pid), sizes in by_writer.items():
            log.warning(
                "pool: %d write lease(s) of client %s expired before the commit; their %d B stay "
                "fenced until the writer is done%s",
                len(sizes),
                client,
                sum(sizes),
                f" or its process {pid} is gone" if pid else f" or {self.grace_s:.0f} s have passed",
            )

    def _add(self, client: str, key: bytes, gva: int, size: int, pid: int, deadline: float) -> Fence:
        tomb = FENCE_PREFIX + gva.to_bytes(8, "little")
        try:
            self.table.insert(tomb, gva, size, 0, SlotState.REMOVING)
        except OutOfSpace:
            tomb = b""  # the extent stays reserved; only a restart would not know of it
        f = Fence(client, key, gva, size, pid, deadline, tomb)
        self.fences[gva] = f
        if client:
            self._by_writer.setdefault((client, key), []).append(gva)
        return f

    def hold(self, client: str, key: bytes, gva: int, size: int, pid: int, deadline: float) -> None:
        """Fence one extent of a put that cannot complete (another of its ranks left) while
        its writer may still copy into it: released like an expired lease's extents."""
        self._add(client, key, gva, size, pid, deadline)
        self.counters.fences += 1

    def adopt(self, gvas: list[int], sizes: list[int], now: float) -> int:
        """After a restart: fence extents the previous service had handed out but not
        published. Extents in windows not present yet are fenced when their rank rejoins."""
        n = 0
        for gva, size in zip(gvas, sizes):
            if self._reserve(gva, size):
                self._add("", b"", gva, size, 0, now + self.grace_s)
                n += 1
            else:
                self._adopted.append((gva, size, now + self.grace_s))
        return n

    def window_added(self, w: Window, now: float) -> None:
        """Fence the adopted extents that lie in a window that just (re)joined."""
        keep = []
        for gva, size, deadline in self._adopted:
            if deadline < now:
                continue
            if w.lo <= gva < w.hi and self._reserve(gva, size):
                self._add("", b"", gva, size, 0, deadline)
            else:
                keep.append((gva, size, deadline))
        self._adopted = keep

    def _reserve(self, gva: int, size: int) -> bool:
        for w in self.windows.values():
            if w.lo <= gva and gva + size <= w.hi:
                try:
                    w.alloc.reserve(gva - w.lo, size)
                except ValueError:
                    return False  # overlaps something already there: nothing to protect
                return True
        return False

    # ------------------------------------------------------------------ release
    def writer_done(self, client: str, key: bytes) -> bool:
        """The writer committed ``key`` after its lease expired: it has stopped copying."""
        gvas = self._by_writer.pop((client, key), None)
        if gvas is None:
            return False
        for gva in gvas:
            if gva in self.fences:
                self._release(gva)
        return True

    def sweep(self, now: float) -> None:
        """Release fences whose writer is gone or, when it cannot be watched, whose grace ran out."""
        for gva, f in list(self.fences.items()):
            if _writer_gone(f, now):
                self._release(gva)
        self._adopted = [a for a in self._adopted if a[2] >= now]

    def drop_window(self, w: Window) -> None:
        """A rank left: its window's fences go with it."""
        for gva in [g for g in self.fences if w.lo <= g < w.hi]:
            f = self.fences.pop(gva)
            self._forget_writer(f, gva)

    def _release(self, gva: int) -> None:
        f = self.fences.pop(gva)
        self._forget_writer(f, gva)
        if f.tomb:
            hit = self.table.find(f.tomb)
            if hit is not None:
                self.table.remove(hit.slot)
        for w in self.windows.values():
            if w.lo <= gva < w.hi:
                w.alloc.free(gva - w.lo, f.size)
                return

    def _forget_writer(self, f: Fence, gva: int) -> None:
        held = self._by_writer.get((f.client, f.key))
        if held is not None:
            if gva in held:
                held.remove(gva)
            if not held:
                del self._by_writer[(f.client, f.key)]

    @property
    def fenced_bytes(self) -> int:
        return sum(f.size for f in self.fences.values())
