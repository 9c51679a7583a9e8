"""``MetaService``: the pool's authoritative state (directory, space, leases, eviction).

The service never touches object bytes: it hands out space (GVAs) and tracks states;
clients copy. It is single-threaded by contract: the RPC server loop (or, embedded, one
lock) serialises every call. The directory lives in the shared-memory table
(``table.py``), which clients on the node read without RPC.

Per call: ``alloc`` puts keys in ALLOCATED with a write lease; ``commit`` turns them
READABLE (or frees them on failure); ``lookup`` hands out read leases (for readers that
cannot use the shared table); ``release`` ends them and says whether the object stayed
intact; ``remove``/``remove_all``/``drop_rank`` make objects disappear at once (space
under a read lease is freed when the last lease ends); ``reregister`` rebuilds the
directory from ranks that own data after a restart; ``tick`` (the upkeep) expires write
leases (handing late writers to the write fence, ``fence.py``), read leases and TTLs.
Eviction is LRU by bytes per window, from ``high_watermark`` down to ``low_watermark``
(the policy is ``eviction.py``'s ``LruByBytes``; which objects are candidates is decided
here), and never touches objects under a lease or not yet READABLE. The records it keeps
(windows, leases, counters) are in ``records.py``.

KV events (``events``: an ``EventQueue`` the node's publisher installs, else None): every
object that becomes READABLE is reported stored, every READABLE object that leaves the
directory (removed, evicted, expired, dropped with its rank) removed, ``remove_all`` as
cleared; each report is an append to the queue (``service/events.py``), nothing more.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from kvfabric.errors import OutOfSpace
from kvfabric.platform.types import Medium
from kvfabric.pool.config import PoolConfig
from kvfabric.pool.service.allocator import ExtentAllocator
from kvfabric.pool.service.eviction import LruByBytes
from kvfabric.pool.service.fence import WriteFence
from kvfabric.pool.service.records import Counters, ReadLease, Window, WriteLease
from kvfabric.pool.service.replicas import ReplicaSlots, client_key, is_replica_key, place
from kvfabric.pool.service.table_writer import TableWriter
from kvfabric.pool.status import Status
from kvfabric.pool.table import SlotState, TableView, now_ticks, ticks_passed
from kvfabric.pool.windows import Addressing
from kvfabric.status import succeeded

if TYPE_CHECKING:
    from kvfabric.pool.service.events import EventQueue

log = logging.getLogger("kvfabric.pool")


class MetaService:
    """See module docstring. ``clock`` is injectable for tests (seconds, monotonic)."""

    def __init__(
        self, config: PoolConfig, table: TableView, addressing: Addressing, clock: object = time.monotonic
    ) -> None:
        self.config = config
        self.table = TableWriter(table)
        self.addr = addressing
        self.clock = clock
        self.windows: dict[tuple[int, Medium], Window] = {}
        self.write_leases: dict[bytes, WriteLease] = {}
        self.read_leases: dict[int, ReadLease] = {}
        self._leased: dict[int, int] = {}  # gva -> read lease count
        self._deferred: dict[int, tuple[Window, int, int]] = {}  # gva -> (window, off, size)
        self._gen = itertools.count(1)
        self._lease_ids = itertools.count(1)
        self.counters = Counters()
        self.fence = WriteFence(self.table, self.windows, self.counters, config.fence_grace_s)
        self.eviction = LruByBytes(config.high_watermark, config.low_watermark)
        self._full_warned = False
        #: when (``clock``) an allocation that fits a window was last refused for space, and
        #: whether that is still the latest outcome (an allocation since clears it): /health
        self.space_refused_at: float | None = None
        self.events: EventQueue | None = None  # KV events (module docstring)
        self.replicas = ReplicaSlots(self.table)  # further extents of objects (replicas.py)
        self._under_warned = False

    # ------------------------------------------------------------------ windows
    def add_window(self, rank: int, medium: Medium, size: int) -> Window:
        if (rank, medium) in self.windows:
            raise ValueError(f"rank {rank} already contributes a {medium.value} window")
        win = Window(
            rank, medium, size, ExtentAllocator(size, self.config.align), self.addr.encode(medium, rank, 0)
        )
        self.windows[(rank, medium)] = win
        self.fence.window_added(win, self.clock())
        return win

    def drop_rank(self, rank: int) -> int:
        """A rank left: its windows and every extent in them disappear now. An object with
        an extent left elsewhere stays readable from it (a replica becomes the primary);
        an object still being written loses the whole put (its other extents are fenced
        until its writer is done). The number of objects gone from the directory."""
        gone = [w for (r, _), w in self.windows.items() if r == rank]
        removed = 0
        for w in gone:
            slots = self._slots_in(w)
            keys = {client_key(self.table.view.key_of(int(s))) for s in slots}
            for key in sorted(keys):
                removed += self._drop_extents_in(key, w)
            for lid in [i for i, lease in self.read_leases.items() if w.lo <= lease.gva < w.hi]:
                self._end_read_lease(lid)
            self.fence.drop_window(w)
            del self.windows[(w.rank, w.medium)]
        return removed

    def _drop_extents_in(self, key: bytes, w: Window) -> int:
        """``key``'s extents in the leaving window ``w`` go; 1 when the object went with them."""
        hit = self.table.find(key)
        if hit is None:
            return 0
        inside = lambda g: w.lo <= g < w.hi  # noqa: E731
        extra = self.replicas.gvas(key)
        if hit.state == SlotState.ALLOCATED:  # a put in flight: all of it or nothing
            lease = self.write_leases.pop(key, None)
            for h in self.replicas.drop_all(key):
                self._fence_or_forget(lease, key, h.gva, h.size, inside(h.gva))
            self.table.remove(self.table.find(key).slot)  # type: ignore[union-attr]
            self._fence_or_forget(lease, key, hit.gva, hit.size, inside(hit.gva))
            return 1
        if hit.state != SlotState.READABLE:
            return 0
        left = [g for g in extra if not inside(g)]
        if not inside(hit.gva):  # the primary stays: only replica slots go
            for g in [g for g in extra if inside(g)]:
                self.replicas.drop(key, g)
                self.counters.replicas_lost += 1
            return 0
        if not left:
            if self.events is not None:
                self.events.removed([key], [hit.gva])
            self.replicas.drop_all(key)
            self.table.remove(self.table.find(key).slot)  # type: ignore[union-attr]
            return 1
        for g in [g for g in extra if inside(g)]:  # a replica in this window goes too
            self.replicas.drop(key, g)
        new = left[0]  # the first surviving replica becomes the primary (no event: still stored)
        self.replicas.drop(key, new)
        self._move_primary(key, new)
        self.counters.promoted += 1
        self.counters.replicas_lost += 1
        return 0

    def _move_primary(self, key: bytes, gva: int) -> None:
        """Point ``key``'s entry at another of its extents (looked up again: removing a
        replica slot may have moved it)."""
        hit = self.table.find(key)
        if hit is not None:
            self.table.update(hit.slot, gva=gva)

    def _fence_or_forget(self, lease: WriteLease | None, key: bytes, gva: int, size: int, gone: bool) -> None:
        """An extent of a put that lost a rank: in the leaving window nothing is left to
        guard; elsewhere its writer may still copy, so it is fenced until the writer is done."""
        if gone:
            return
        if lease is None:
            self._free_extent(gva, size)
        else:
            self.fence.hold(lease.client, key, gva, size, lease.pid, self.clock() + self.config.fence_grace_s)

    def _window_of(self, gva: int) -> Window:
        medium, rank, _ = self.addr.decode(gva)
        return self.windows[(rank, medium)]

    def _slots_in(self, w: Window) -> np.ndarray:
        s = self.table.slots
        return np.flatnonzero((s["hash"] != 0) & (s["gva"] >= w.lo) & (s["gva"] < w.hi))

    # ------------------------------------------------------------------ writes
    def alloc(
        self,
        client: str,
        keys: list[bytes],
        sizes: list[int],
        home_rank: int | None = None,
        preferred_rank: int | None = None,
        medium: Medium | None = None,
        pid: int = 0,
        replicas: int | None = None,
        nodes: Mapping[int, str] | None = None,
    ) -> tuple[list[int], list[int], list[int]]:
        """Space for each key: ``(status, gva, generation)`` lists. ``pid``: the writer's
        process when it runs on this node (its fenced space is released when it dies).
        ``replicas``: extents a key (None: the pool's ``replicas``), placed on distinct
        nodes (``nodes``: rank -> node id; a rank not in it is a node of its own), then
        distinct ranks (``replicas.place``); the further extents' gvas are the write
        lease's ``extra`` (:meth:`extents`). Fewer ranks than asked: fewer extents,
        counted in ``under_replicated``."""
        now = self.clock()
        n = self.config.replicas if replicas is None else replicas
        node_of = (lambda r: nodes.get(r, f"rank:{r}")) if nodes else (lambda r: f"rank:{r}")
        st, gvas, gens = [], [], []
        for key, size in zip(keys, sizes):
            s, g, gen = self._alloc_one(
                client, key, size, home_rank, preferred_rank, medium, now, pid, n, node_of
            )
            st.append(s)
            gvas.append(g)
            gens.append(gen)
        self.counters.count("alloc", len(keys), sum(1 for s in st if not succeeded(s)))
        return st, gvas, gens

    def extents(self, key: bytes) -> list[int]:
        """The further extents' gvas of a key being written (its write lease's), else []."""
        lease = self.write_leases.get(key)
        return list(lease.extra) if lease is not None else []

    def _candidates(self, home: int | None, preferred: int | None, medium: Medium | None) -> list[Window]:
        wins = [w for w in self.windows.values() if medium is None or w.medium is medium]
        wins.sort(key=lambda w: (w.rank != preferred, w.rank != home, -w.alloc.free_bytes))
        return wins

    def _alloc_one(
        self,
        client: str,
        key: bytes,
        size: int,
        home: int | None,
        preferred: int | None,
        medium: Medium | None,
        now: float,
        pid: int = 0,
        replicas: int = 1,
        node_of: object = None,
    ) -> tuple[int, int, int]:
        if size <= 0:
            return Status.INVALID, 0, 0
        if self.table.find(key) is not None:
            return Status.EXISTS, 0, 0
        wins = [
            w for w in self._candidates(home, preferred, medium) if w.alloc.round(size) <= w.alloc.capacity
        ]
        nodes = node_of if callable(node_of) else (lambda r: f"rank:{r}")
        # free space first, then evict (in placement order) for the extents still missing:
        # on distinct nodes, and only then on other ranks of the nodes already used
        free = lambda w: w.alloc.alloc(size)  # noqa: E731
        evict = lambda w: w.alloc.alloc(size) if self._evict(w, need=size) else None  # noqa: E731
        placed: list[tuple[Window, int]] = []
        for fits, nodes_only in ((free, True), (evict, True), (free, False), (evict, False)):
            if len(placed) >= replicas or (not nodes_only and replicas == 1):
                break
            placed = place(wins, replicas, nodes, fits, placed, nodes_only)
        if not placed:
            if wins:  # it would fit a window: the pool is full, not the request too large
                self.space_refused_at = now
            return Status.NO_SPACE, 0, 0
        gen = next(self._gen)
        (w, off), rest = placed[0], placed[1:]
        gva = w.lo + off
        extra = [rw.lo + roff for rw, roff in rest]
        if not self._insert(key, gva, size, gen) or not self._insert_replicas(key, extra, size, gen):
            for pw, poff in placed:
                pw.alloc.free(poff, size)
            self.space_refused_at = now
            return Status.NO_SPACE, 0, 0
        lease = WriteLease(client, gva, size, gen, now + self.config.write_lease_s, pid, tuple(extra))
        self.write_leases[key] = lease
        for pw, _ in placed:
            self._watermark(pw)
        self.space_refused_at = None
        if len(placed) < replicas:
            self.counters.under_replicated += 1
            if not self._under_warned:
                self._under_warned = True
                log.warning(
                    "pool: %d replica(s) asked, %d rank(s) with a window could take one; objects are "
                    "stored with fewer (counted in under_replicated)",
                    replicas,
                    len(placed),
                )
        return Status.OK, gva, gen

    def _insert_replicas(self, key: bytes, gvas: list[int], size: int, gen: int) -> bool:
        """The ALLOCATED replica slots of a new object; False (nothing left behind, the
        primary slot taken out too) when the directory is full."""
        try:
            for g in gvas:
                self.replicas.add(key, g, size, gen, SlotState.ALLOCATED)
        except OutOfSpace:
            self.replicas.drop_all(key)
            hit = self.table.find(key)
            if hit is not None:
                self.table.remove(hit.slot)
            return False
        return True

    def _insert(self, key: bytes, gva: int, size: int, gen: int) -> bool:
        """A new ALLOCATED slot; a full directory evicts its least recently used object."""
        for _ in range(2):
            try:
                self.table.insert(key, gva, size, gen, SlotState.ALLOCATED)
                return True
            except OutOfSpace as e:
                if not self._evict_one_slot():
                    if not self._full_warned:
                        self._full_warned = True
                        log.warning(
                            "pool directory full (max_objects=%d) and nothing evictable: %s",
                            self.config.max_objects,
                            e,
                        )
                    return False
        return False

    def _evict_one_slot(self) -> bool:
        """Evict the least recently used READABLE object not under a read lease (any window)."""
        s = self.table.slots
        idx = np.flatnonzero(s["state"] == int(SlotState.READABLE))
        if self._leased and idx.size:
            leased = np.fromiter(self._leased, np.uint64, len(self._leased))
            idx = idx[~np.isin(s["gva"][idx], leased)]
        if not idx.size:
            return False
        slot_i = int(idx[self.eviction.oldest(s["atime"][idx])])
        key = self.table.view.key_of(slot_i)
        hit = self.table.find(key)
        if hit is None:
            return False
        self._free_object(hit.slot, key, hit.gva, hit.size)
        self.counters.evicted_objects += 1
        self.counters.evicted_bytes += hit.size
        return True

    def commit(
        self,
        client: str,
        keys: list[bytes],
        ok: list[bool],
        ttl_s: float | None = None,
        sums: list[int] | None = None,
    ) -> list[int]:
        """Publish (``ok``) or abandon each allocated key of ``client``. ``sums``: the
        writer's checksum of each object (``platform.checksum``; 0 or absent: none). A
        commit of a key whose lease expired releases its fenced space (the writer has
        stopped copying) and answers LEASE_EXPIRED."""
        ttl = self.config.default_ttl_s if ttl_s is None else ttl_s
        expire = (now_ticks() + int(ttl * 10)) & 0xFFFFFFFF if ttl > 0 else 0
        out = []
        published: tuple[list[bytes], list[int]] = ([], [])
        for i, (key, good) in enumerate(zip(keys, ok)):
            lease = self.write_leases.get(key)
            if lease is None or lease.client != client:
                self.fence.writer_done(client, key)
                out.append(Status.LEASE_EXPIRED)
                continue
            del self.write_leases[key]
            hit = self.table.find(key)
            if hit is None or hit.gen != lease.gen:
                out.append(Status.LEASE_EXPIRED)
                continue
            if good:
                csum = int(sums[i]) if sums else 0
                for r in self.replicas.hits(key):  # every extent was written: all of them serve
                    self.table.set_state(r.slot, SlotState.REPLICA, 0, csum)
                self.table.set_state(hit.slot, SlotState.READABLE, expire, csum)
                published[0].append(key)
                published[1].append(hit.gva)
                out.append(Status.OK)
            else:
                self._free_object(hit.slot, key, hit.gva, hit.size)
                out.append(Status.OK)
        self.counters.count("commit", len(keys), sum(1 for s in out if s != Status.OK))
        if self.events is not None and published[0]:
            self.events.stored(*published)
        return out

    def renew(self, client: str, keys: list[bytes]) -> list[int]:
        """Extend the write leases ``client`` holds on ``keys`` (a long copy in flight)."""
        until = self.clock() + self.config.write_lease_s
        out = []
        for key in keys:
            lease = self.write_leases.get(key)
            if lease is None or lease.client != client:
                out.append(Status.LEASE_EXPIRED)
                continue
            lease.expires = until
            out.append(Status.OK)
        self.counters.count("renew", len(keys), out.count(Status.LEASE_EXPIRED))
        return out

    # ------------------------------------------------------------------ reads
    def lookup(
        self, keys: list[bytes], lease: bool = True
    ) -> tuple[list[int], list[int], list[int], list[int], list[int], list[int]]:
        """``(status, gva, size, gen, lease_id, checksum)`` per key; lease_id 0 without a
        lease. Recency is marked the way on-node readers mark it (outside the slot's
        sequence counter), so remote reads never make on-node readers retry."""
        return self.lookup_extents(keys, lease)[:6]  # type: ignore[return-value]

    def lookup_extents(
        self, keys: list[bytes], lease: bool = True
    ) -> tuple[list[int], list[int], list[int], list[int], list[int], list[int], list[list[int]]]:
        """``lookup`` and, per key, the gvas of its further extents (replicas); a read
        lease holds every extent of the object."""
        now = self.clock()
        st, gvas, sizes, gens, lids, sums, extra = [], [], [], [], [], [], []
        for key in keys:
            hit = self._readable(key)
            if hit is None:
                st.append(Status.NOT_FOUND)
                gvas.append(0), sizes.append(0), gens.append(0), lids.append(0), sums.append(0)
                extra.append([])
                continue
            more = self.replicas.gvas(key)
            lid = 0
            if lease:
                lid = next(self._lease_ids)
                held = ReadLease(key, hit.gva, hit.gen, now + self.config.read_lease_s, tuple(more))
                self.read_leases[lid] = held
                for g in (hit.gva, *more):
                    self._leased[g] = self._leased.get(g, 0) + 1
            self.table.view.touch(hit.slot)
            st.append(Status.OK)
            gvas.append(hit.gva), sizes.append(hit.size), gens.append(hit.gen), lids.append(lid)
            sums.append(hit.csum), extra.append(more)
        self.counters.count("lookup", len(keys), st.count(Status.NOT_FOUND))
        return st, gvas, sizes, gens, lids, sums, extra

    def release(self, lease_ids: list[int]) -> list[int]:
        """End read leases: OK if the object stayed intact for the whole lease."""
        now = self.clock()
        out = []
        for lid in lease_ids:
            lease = self.read_leases.get(lid)
            if lease is None:
                out.append(Status.LEASE_EXPIRED)
                continue
            expired = lease.expires < now
            self._end_read_lease(lid)
            out.append(Status.LEASE_EXPIRED if expired else Status.OK)
        return out

    def _end_read_lease(self, lid: int) -> None:
        lease = self.read_leases.pop(lid)
        for gva in (lease.gva, *lease.extra):
            left = self._leased.get(gva, 0) - 1
            if left > 0:
                self._leased[gva] = left
                continue
            self._leased.pop(gva, None)
            deferred = self._deferred.pop(gva, None)
            if deferred is not None:
                w, off, size = deferred
                w.alloc.free(off, size)

    def _readable(self, key: bytes):  # noqa: ANN202 - Hit | None
        hit = self.table.find(key)
        if hit is None or hit.state != SlotState.READABLE:
            return None
        if hit.expire and ticks_passed(hit.expire):
            self._free_object(hit.slot, key, hit.gva, hit.size)
            return None
        return hit

    def exists(self, keys: list[bytes]) -> list[bool]:
        self.counters.count("exists", len(keys))
        return [self._readable(k) is not None for k in keys]

    # ------------------------------------------------------------------ removal
    def remove(self, keys: list[bytes], gvas: list[int] | None = None) -> list[int]:
        """Take readable objects out of the directory. A key still being written is not
        visible, so it is NOT_FOUND here too, and its write goes on. ``gvas``: take out
        only that extent of each object (a replica a reader found corrupt); the object
        goes when it was its last one; NOT_FOUND when the object has no extent there."""
        out = []
        for i, key in enumerate(keys):
            hit = self.table.find(key)
            if hit is None or hit.state != SlotState.READABLE:
                out.append(Status.NOT_FOUND)
                continue
            if gvas is not None:
                out.append(self._remove_extent(hit, key, int(gvas[i])))
                continue
            self._free_object(hit.slot, key, hit.gva, hit.size)
            out.append(Status.OK)
        self.counters.count("remove", len(keys), out.count(Status.NOT_FOUND))
        return out

    def _remove_extent(self, hit, key: bytes, gva: int) -> int:  # noqa: ANN001 - a table Hit
        extra = self.replicas.gvas(key)
        if gva != hit.gva and gva not in extra:
            return Status.NOT_FOUND
        if not extra:
            self._free_object(hit.slot, key, hit.gva, hit.size)
            return Status.OK
        if gva == hit.gva:  # the primary goes: its first replica takes its place
            self.replicas.drop(key, extra[0])
            self._move_primary(key, extra[0])
        else:
            self.replicas.drop(key, gva)
        self._free_extent(gva, hit.size)
        return Status.OK

    def remove_all(self) -> int:
        live = np.flatnonzero(self.table.slots["state"] == int(SlotState.READABLE))
        keys = [self.table.view.key_of(int(s)) for s in live]
        events, self.events = self.events, None  # one AllBlocksCleared, not a removal each
        try:
            return self.remove(keys).count(Status.OK)
        finally:
            self.events = events
            if events is not None:
                events.cleared()

    def _free_object(self, slot: int, key: bytes, gva: int, size: int) -> None:
        """Take ``key`` out of the directory now, every extent of it; free their space
        unless a read lease holds it."""
        if self.events is not None and self.table.slots["state"][slot] == SlotState.READABLE:
            self.events.removed([key], [gva])
        self.table.remove(slot)
        more = self.replicas.drop_all(key)
        for g in (gva, *(h.gva for h in more)):
            self._free_extent(g, size)

    def _free_extent(self, gva: int, size: int) -> None:
        """Free one extent's space, or defer it while a read lease holds it."""
        try:
            w = self._window_of(gva)
        except KeyError:
            return  # its rank already left
        if self._leased.get(gva):
            self._deferred[gva] = (w, gva - w.lo, size)
        else:
            w.alloc.free(gva - w.lo, size)

    def reregister(
        self,
        keys: list[bytes],
        gvas: list[int],
        sizes: list[int],
        gens: list[int],
        sums: list[int] | None = None,
    ) -> list[int]:
        """Rebuild: a rank that owns data reports objects it holds (READABLE ones only),
        with their checksums. Each owner reports its own extent of an object, so extents of
        one key arrive apart: one of the same generation, size and checksum as the entry
        already there joins it as a replica (OK); one of a newer generation replaces the
        entry (the older one was removed before the key was stored again); an older or
        disagreeing one, or one already there, is EXISTS and changes nothing."""
        out = []
        published: tuple[list[bytes], list[int]] = ([], [])
        for i, (key, gva, size, gen) in enumerate(zip(keys, gvas, sizes, gens)):
            csum = int(sums[i]) if sums else 0
            try:
                w = self._window_of(gva)
                hit = self.table.find(key)
                if hit is not None and not self._merge_first(hit, key, gva, size, gen, csum):
                    out.append(Status.EXISTS)
                    continue
                w.alloc.reserve(gva - w.lo, size)
            except (KeyError, ValueError):
                out.append(Status.INVALID)
                continue
            self._gen = itertools.count(max(next(self._gen), gen + 1))
            hit = self.table.find(key)
            if hit is not None:  # a further extent of an object already entered
                try:
                    self.replicas.add(key, gva, size, gen, SlotState.REPLICA, csum)
                except (OutOfSpace, ValueError):
                    w.alloc.free(gva - w.lo, size)
                    out.append(Status.NO_SPACE)
                    continue
                out.append(Status.OK)
                continue
            slot, _ = self.table.insert(key, gva, size, gen, SlotState.READABLE)
            if csum:
                self.table.update(slot, csum=csum)
            published[0].append(key)
            published[1].append(gva)
            out.append(Status.OK)
        if self.events is not None and published[0]:
            self.events.stored(*published)
        return out

    def _merge_first(self, hit, key: bytes, gva: int, size: int, gen: int, csum: int) -> bool:  # noqa: ANN001
        """Whether an extent reported for a key already entered may go in (see ``reregister``):
        the same object's (it joins as a replica), or a newer object's (the entry there is
        freed first). False: nothing to do."""
        if hit.state != SlotState.READABLE:
            return False
        if gen > hit.gen:
            self._free_object(hit.slot, key, hit.gva, hit.size)
            return True
        if gen < hit.gen or size != hit.size or (csum and hit.csum and csum != hit.csum):
            return False
        return gva != hit.gva and gva not in self.replicas.gvas(key)

    def held(self, rank: int) -> tuple[list[bytes], list[int], list[int], list[int], list[int]]:
        """The committed extents that lie in ``rank``'s windows, primaries and replicas:
        ``(keys, gvas, sizes, gens, checksums)`` (an owner's copy of what to re-register
        with a new leader)."""
        s = self.table.slots
        inside = np.zeros(s.shape[0], bool)
        for (r, _), w in self.windows.items():
            if r == rank:
                inside |= (s["gva"] >= w.lo) & (s["gva"] < w.hi)
        state = s["state"]
        idx = np.flatnonzero(
            inside & (s["hash"] != 0) & ((state == SlotState.READABLE) | (state == SlotState.REPLICA))
        )
        keys = [client_key(self.table.view.key_of(int(i))) for i in idx.tolist()]
        self.counters.count("held", 1)
        return (
            keys,
            s["gva"][idx].tolist(),
            s["size"][idx].tolist(),
            s["gen"][idx].tolist(),
            s["csum"][idx].tolist(),
        )

    def replica_slots(self) -> int:
        """Committed replica slots in the directory (further extents: not objects)."""
        return int(np.count_nonzero(self.table.slots["state"] == SlotState.REPLICA))

    def capacity(self) -> list[dict[str, int | str]]:
        return [
            {
                "rank": w.rank,
                "medium": w.medium.value,
                "capacity": w.alloc.capacity,
                "used": w.alloc.used,
                "free": w.alloc.free_bytes,
                "evictions": w.evictions,
                "fenced": sum(f.size for g, f in self.fence.fences.items() if w.lo <= g < w.hi),
            }
            for w in sorted(self.windows.values(), key=lambda w: (w.rank, w.medium.value))
        ]

    # ------------------------------------------------------------------ eviction
    def _evict(self, w: Window, need: int) -> bool:
        """Evict LRU objects of ``w`` until ``need`` bytes fit or nothing is evictable."""
        s = self.table.slots
        idx = self._slots_in(w)
        state = s["state"][idx]
        idx = idx[(state == SlotState.READABLE) | (state == SlotState.REPLICA)]
        if self._leased:
            leased = np.fromiter(self._leased, np.uint64, len(self._leased))
            idx = idx[~np.isin(s["gva"][idx], leased)]
        raw = [self.table.view.key_of(int(i)) for i in idx.tolist()]  # slots move as objects go
        stamps = s["atime"][idx].copy()
        for j, k in enumerate(raw):  # a replica is as recent as its object (readers touch the primary)
            if is_replica_key(k) and (p := self.table.find(client_key(k))) is not None:
                stamps[j] = s["atime"][p.slot]
        keys = [raw[j] for j in self.eviction.order(stamps).tolist()]

        def free(raw: bytes) -> bool:
            key = client_key(raw)  # a replica here evicts its whole object (all extents together)
            hit = self.table.find(key)
            if hit is None or hit.state != SlotState.READABLE:
                return False
            if self._leased and any(self._leased.get(g) for g in (hit.gva, *self.replicas.gvas(key))):
                return False
            self._free_object(hit.slot, key, hit.gva, hit.size)
            w.evictions += 1
            self.counters.evicted_objects += 1
            self.counters.evicted_bytes += hit.size
            return True

        return self.eviction.evict(w.alloc, w.size, need, keys, free)[0]

    def _watermark(self, w: Window) -> None:
        if self.eviction.over_high(w.alloc.used, w.size):
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


__all__ = ["MetaService", "Status", "Window"]
