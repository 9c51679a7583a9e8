"""``Dispatcher``: turns protocol requests into ``MetaService`` calls, one at a time.

Both the RPC server loop and the embedded (in-process) transport go through it, under
its lock, so the service stays single-threaded whatever calls it. It also applies the
pool's membership (``apply_table``, called by the node on every segment-table change of
the GVA fabric): a rank that joins with windows gets them allocatable, a rank that
leaves or dies takes its objects out of the directory at once.

Every request is checked whole before the service sees it (``check_request``): keys
(binary, 1 to 256 bytes, each list checked at once), sizes (> 0, no larger than a window
can be), ids, counts (at most ``MAX_BATCH`` a list, parallel lists of equal length), ranks (in the
address space; ``preferred_rank`` one that contributes a window), mediums, TTLs, and the
addresses of ``reregister`` (inside a window of the pool). A request that fails any check
gets an ``error`` reply naming the field and the first bad index, and changes nothing;
the socket's decoder refuses some of the same earlier (``protocol.py``), but in-process
callers reach the dispatcher directly, so it checks everything itself.

Leadership (a pool whose meta services are elected, ``leader.py``): with a ``gate`` set,
every request but ``Info`` / ``Hello`` first asks it, under the lock, right before the
service acts; a refusal (the gate's reason) is answered ``NOT_LEADER`` and changes
nothing. While ``hold_allocs_until`` (monotonic seconds) has not passed, ``Alloc``
answers ``UNAVAILABLE`` for every key (a new leader's grace: writers the previous one
let in may still be copying). ``leader_info`` adds fields to ``Info``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kvfabric.platform.types import Medium
from kvfabric.pool import protocol as p
from kvfabric.pool.gva.address import REGION_SIZE
from kvfabric.pool.gva.segments import SegmentTable
from kvfabric.pool.keys import (
    MAX_KEY_BYTES,
    MAX_TTL_S,
    check_int,
    check_ints,
    check_keys,
    check_lengths,
    check_sizes,
    key_text,
)
from kvfabric.pool.service.meta import MetaService
from kvfabric.pool.service.metrics import PoolMetrics
from kvfabric.pool.status import Status

log = logging.getLogger("kvfabric.pool")


class Dispatcher:
    """Serialises requests onto one :class:`MetaService` (see module docstring)."""

    def __init__(
        self,
        service: MetaService,
        epoch: int,
        info: dict[str, Any],
        metrics: PoolMetrics | None = None,
    ) -> None:
        self.service = service
        self.epoch = epoch
        self.lock = threading.Lock()
        self.metrics = metrics or PoolMetrics()
        self._info = dict(info)
        self.started = time.time()
        #: leadership (see module docstring); all three are set by the node, None/0: none
        self.gate: Callable[[], str | None] | None = None
        self.hold_allocs_until = 0.0
        self.leader_info: Callable[[], dict[str, Any]] | None = None
        #: rank -> node id of every member with a window (``apply_table``): replicas go to
        #: distinct nodes. Kept here, not in the service, so a fresh directory keeps it.
        self.nodes: dict[int, str] = {}

    def _refusal(self, req: Any) -> p.Reply | None:
        """A ``NOT_LEADER`` reply when the gate refuses ``req`` (call under the lock)."""
        if self.gate is None or isinstance(req, (p.Info, p.Hello)):
            return None
        why = self.gate()
        return None if why is None else p.Reply(self.epoch, error=f"{p.NOT_LEADER}: {why}")

    def handle(self, req: Any, pid: int = 0) -> p.Reply:
        """Serve one request. ``pid``: the caller's process when it is on this node (the
        RPC server reads it from the Unix socket; in-process callers pass their own), so
        space fenced for a writer that stalled is released once that process is gone."""
        op = type(req).__struct_config__.tag
        t0 = time.perf_counter()
        if isinstance(req, p.ListKeys):  # pages of a large pool: not under the lock
            reply = self._list_keys_reply(req)
            self.metrics.observe(op, time.perf_counter() - t0, reply)
            return reply
        with self.lock:
            try:
                self.check_request(req)
                reply = self._refusal(req) or self._dispatch(req, pid)
            except (ValueError, TypeError, KeyError) as e:
                reply = p.Reply(self.epoch, error=f"{op}: {e}")
            self.metrics.observe(op, time.perf_counter() - t0, reply)
        return reply

    def tick(self) -> None:
        with self.lock:  # the state gauges are refreshed when /metrics is read, not here
            self.service.tick()

    def apply_table(self, table: SegmentTable) -> None:
        """Make the service's windows match the fabric's segment table."""
        with self.lock:
            s = self.service
            want = {(seg.rank, seg.medium): seg.nbytes for seg in table.segments}
            self.nodes = {seg.rank: seg.node for seg in table.segments}
            for rank in sorted({r for r, _ in s.windows} - {r for r, _ in want}):
                removed = s.drop_rank(rank)
                log.info("pool rank %d left; %d object(s) dropped from the directory", rank, removed)
            for (rank, medium), size in want.items():
                if (rank, medium) not in s.windows:
                    s.add_window(rank, medium, size)
                    log.info("pool rank %d contributes %d B of %s", rank, size, medium.value)

    def check_request(self, req: Any) -> None:
        """Refuse a request with a bad field (``ValueError`` naming it); call under the lock."""
        if isinstance(req, p.Remove) and req.gvas is not None:
            check_lengths("keys", req.keys, gvas=req.gvas)
            check_ints(req.gvas, "gvas")
        if isinstance(req, (p.Lookup, p.Exists, p.Remove, p.Renew)):
            check_keys(req.keys)
        elif isinstance(req, p.Held):
            self._check_rank(req.rank, "rank")
        elif isinstance(req, p.Alloc):
            check_lengths("keys", req.keys, sizes=req.sizes)
            check_keys(req.keys)
            check_sizes(req.sizes, hi=self._max_object())
            if req.home_rank is not None:
                self._check_rank(req.home_rank, "home_rank")
            if req.preferred_rank is not None:
                self._check_rank(req.preferred_rank, "preferred_rank")
                if req.preferred_rank not in {r for r, _ in self.service.windows}:
                    raise ValueError(f"preferred_rank {req.preferred_rank} contributes no window to the pool")
            if req.medium is not None:
                Medium.parse(req.medium)
            if req.replicas is not None:
                p.check_replicas(req.replicas)
        elif isinstance(req, p.Commit):
            check_lengths("keys", req.keys, ok=req.ok, **({} if req.sums is None else {"sums": req.sums}))
            if req.sums is not None:
                check_ints(req.sums, "sums")
            check_keys(req.keys)
            if not all(isinstance(f, bool) for f in req.ok):
                raise ValueError("ok holds booleans")
            ttl = req.ttl_s
            number = isinstance(ttl, (int, float)) and not isinstance(ttl, bool)
            if ttl is not None and not (number and 0 <= ttl <= MAX_TTL_S):
                raise ValueError(f"ttl_s = {ttl!r}: must be a number of seconds in [0, {MAX_TTL_S:.0f}]")
        elif isinstance(req, p.Release):
            check_ints(req.lease_ids, "lease_ids")
        elif isinstance(req, p.Reregister):
            extra = {} if req.sums is None else {"sums": req.sums}
            check_lengths("keys", req.keys, gvas=req.gvas, sizes=req.sizes, gens=req.gens, **extra)
            check_keys(req.keys)
            sizes = check_sizes(req.sizes, hi=self._max_object())
            check_ints(req.gens, "gens")
            for i, (gva, size) in enumerate(zip(check_ints(req.gvas, "gvas"), sizes)):
                self._check_extent(gva, size, f"gvas[{i}]")
        elif isinstance(req, p.ListKeys):
            if not isinstance(req.prefix, bytes) or len(req.prefix) > MAX_KEY_BYTES:
                raise ValueError(f"prefix must be at most {MAX_KEY_BYTES} bytes, got {req.prefix[:40]!r}")
            check_int(req.start, "start")
            check_int(req.limit, "limit")

    def _max_object(self) -> int:
        """No object is larger than the address range of one window."""
        return int(getattr(self.service.addr, "stride", REGION_SIZE))

    def _check_rank(self, rank: Any, name: str) -> None:
        check_int(rank, name)
        try:
            self.service.addr.encode(Medium.DRAM, rank, 0)
        except ValueError as e:
            raise ValueError(f"{name} = {rank}: {e}") from None

    def _check_extent(self, gva: int, size: int, name: str) -> None:
        """``[gva, gva + size)`` lies inside one window of the pool."""
        try:
            medium, rank, off = self.service.addr.decode(gva)
        except ValueError as e:
            raise ValueError(f"{name} = {gva:#x}: {e}") from None
        w = self.service.windows.get((rank, medium))
        if w is None:
            raise ValueError(f"{name} = {gva:#x}: rank {rank} has no {medium.value} window in the pool")
        if off + size > w.size:
            raise ValueError(
                f"{name} = {gva:#x}: {size} B at offset {off} run past the {w.size} B window of rank {rank}"
            )

    def _dispatch(self, req: Any, pid: int = 0) -> p.Reply:
        s, e = self.service, self.epoch
        if isinstance(req, p.Lookup):
            st, g, sz, gen, lid, sums, more = s.lookup_extents(req.keys, req.lease)
            extra = more if any(more) else []
            return p.Reply(e, status=st, gvas=g, sizes=sz, gens=gen, lease_ids=lid, sums=sums, replicas=extra)
        if isinstance(req, p.Alloc):
            if self.hold_allocs_until and time.monotonic() < self.hold_allocs_until:
                return p.Reply(e, status=[int(Status.UNAVAILABLE)] * len(req.keys), gvas=[0] * len(req.keys))
            medium = None if req.medium is None else Medium.parse(req.medium)
            st, g, gen = s.alloc(
                req.client,
                req.keys,
                req.sizes,
                req.home_rank,
                req.preferred_rank,
                medium,
                pid,
                req.replicas,
                self.nodes,
            )
            more = [s.extents(k) if x == Status.OK else [] for k, x in zip(req.keys, st)]
            return p.Reply(e, status=st, gvas=g, gens=gen, replicas=more if any(more) else [])
        if isinstance(req, p.Commit):
            return p.Reply(e, status=s.commit(req.client, req.keys, req.ok, req.ttl_s, req.sums))
        if isinstance(req, p.Renew):
            return p.Reply(e, status=s.renew(req.client, req.keys))
        if isinstance(req, p.Exists):
            return p.Reply(e, flags=s.exists(req.keys))
        if isinstance(req, p.Release):
            return p.Reply(e, status=s.release(req.lease_ids))
        if isinstance(req, p.Remove):
            return p.Reply(e, status=s.remove(req.keys, req.gvas))
        if isinstance(req, p.Held):
            keys, g, sz, gen, sums = s.held(req.rank)
            return p.Reply(e, keys=keys, gvas=g, sizes=sz, gens=gen, sums=sums)
        if isinstance(req, p.RemoveAll):
            return p.Reply(e, data={"removed": s.remove_all()})
        if isinstance(req, p.Reregister):
            return p.Reply(e, status=s.reregister(req.keys, req.gvas, req.sizes, req.gens, req.sums))
        if isinstance(req, (p.Info, p.Hello)):
            return p.Reply(e, data=self.info())
        raise ValueError(f"unsupported request {type(req).__name__}")

    def info(self) -> dict[str, Any]:
        s = self.service
        return {
            **self._info,
            "epoch": self.epoch,
            "write_lease_s": s.config.write_lease_s,
            "verify": s.config.verify,
            "replicas": s.config.replicas,
            "replica_sync_s": s.config.replica_sync_s,
            "objects": s.table.count - s.replica_slots(),
            "replica_extents": s.replica_slots(),
            "replication": {  # replicas.py: puts placed short, copies taking over, copies lost
                "under_replicated": s.counters.under_replicated,
                "promoted": s.counters.promoted,
                "lost": s.counters.replicas_lost,
            },
            "max_objects": s.table.capacity,
            "ranks": sorted({r for r, _ in s.windows}),
            "capacity": s.capacity(),
            "uptime_s": round(time.time() - self.started, 1),
            **(self.leader_info() if self.leader_info is not None else {}),
        }

    def _list_keys_reply(self, req: p.ListKeys) -> p.Reply:
        """``ListKeys``: the readable keys are copied out of the table under the lock (array
        copies, no Python per key), then filtered, sorted and paged after letting go, so
        listing a pool of 10^6 objects does not hold up its metadata RPCs."""
        with self.lock:
            try:
                self.check_request(req)
            except (ValueError, TypeError) as e:
                return p.Reply(self.epoch, error=f"list_keys: {e}")
            refused = self._refusal(req)
            if refused is not None:
                return refused
            epoch = self.epoch
            offsets, lengths, arena = self.service.table.view.readable_keys()
        keys = sorted(
            k
            for k in (arena[o : o + n] for o, n in zip(offsets.tolist(), lengths.tolist(), strict=True))
            if k.startswith(req.prefix)
        )
        page = keys[req.start : req.start + max(0, min(req.limit, 10_000))]
        nxt = req.start + len(page)
        return p.Reply(
            epoch,
            data={
                "keys": [key_text(k) for k in page],  # binary bytes as \xNN (keys.key_text)
                "total": len(keys),
                "next": nxt if nxt < len(keys) else None,
            },
        )
