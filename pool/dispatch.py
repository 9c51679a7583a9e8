"""``Dispatcher``: turns protocol requests into ``MetaService`` calls, one at a time.

Both the RPC server loop and the embedded (in-process) transport go through it, under
its lock, so the service stays single-threaded whatever calls it. It also applies the
pool's membership (``apply_table``, called by the node on every segment-table change of
the GVA fabric): a rank that joins with windows gets them allocatable, a rank that
leaves or dies takes its objects out of the directory at once.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from kvfabric.platform.types import Medium
from kvfabric.pool import protocol as p
from kvfabric.pool.gva.segments import SegmentTable
from kvfabric.pool.meta import MetaService
from kvfabric.pool.metrics import PoolMetrics

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

    def handle(self, req: Any) -> p.Reply:
        op = type(req).__struct_config__.tag
        t0 = time.perf_counter()
        with self.lock:
            try:
                reply = self._dispatch(req)
            except (ValueError, TypeError, KeyError) as e:
                reply = p.Reply(self.epoch, error=f"{op}: {e}")
            self.metrics.observe(op, time.perf_counter() - t0, reply)
        return reply

    def tick(self) -> None:
        with self.lock:
            self.service.tick()
            self.metrics.update_state(self.service)

    def apply_table(self, table: SegmentTable) -> None:
        """Make the service's windows match the fabric's segment table."""
        with self.lock:
            s = self.service
            want = {(seg.rank, seg.medium): seg.nbytes for seg in table.segments}
            for rank in sorted({r for r, _ in s.windows} - {r for r, _ in want}):
                removed = s.drop_rank(rank)
                log.info("pool rank %d left; %d object(s) dropped from the directory", rank, removed)
            for (rank, medium), size in want.items():
                if (rank, medium) not in s.windows:
                    s.add_window(rank, medium, size)
                    log.info("pool rank %d contributes %d B of %s", rank, size, medium.value)

    def _dispatch(self, req: Any) -> p.Reply:
        s, e = self.service, self.epoch
        if isinstance(req, p.Lookup):
            st, g, sz, gen, lid = s.lookup(req.keys, req.lease)
            return p.Reply(e, status=st, gvas=g, sizes=sz, gens=gen, lease_ids=lid)
        if isinstance(req, p.Alloc):
            medium = None if req.medium is None else Medium.parse(req.medium)
            st, g, gen = s.alloc(req.client, req.keys, req.sizes, req.home_rank, req.preferred_rank, medium)
            return p.Reply(e, status=st, gvas=g, gens=gen)
        if isinstance(req, p.Commit):
            return p.Reply(e, status=s.commit(req.client, req.keys, req.ok, req.ttl_s))
        if isinstance(req, p.Exists):
            return p.Reply(e, flags=s.exists(req.keys))
        if isinstance(req, p.Release):
            return p.Reply(e, status=s.release(req.lease_ids))
        if isinstance(req, p.Remove):
            return p.Reply(e, status=s.remove(req.keys))
        if isinstance(req, p.RemoveAll):
            return p.Reply(e, data={"removed": s.remove_all()})
        if isinstance(req, p.Reregister):
            return p.Reply(e, status=s.reregister(req.keys, req.gvas, req.sizes, req.gens))
        if isinstance(req, p.ListKeys):
            return p.Reply(e, data=self._list_keys(req))
        if isinstance(req, (p.Info, p.Hello)):
            return p.Reply(e, data=self.info())
        raise ValueError(f"unsupported request {type(req).__name__}")

    def info(self) -> dict[str, Any]:
        s = self.service
        return {
            **self._info,
            "epoch": self.epoch,
            "objects": s.table.count,
            "max_objects": s.table.capacity,
            "ranks": sorted({r for r, _ in s.windows}),
            "capacity": s.capacity(),
            "uptime_s": round(time.time() - self.started, 1),
        }

    def _list_keys(self, req: p.ListKeys) -> dict[str, Any]:
        import numpy as np

        view = self.service.table.view
        live = np.flatnonzero(view.slots["state"] == 2)  # READABLE
        keys = sorted(k for k in (view.key_of(int(i)) for i in live) if k.startswith(req.prefix))
        page = keys[req.start : req.start + max(0, min(req.limit, 10_000))]
        nxt = req.start + len(page)
        return {
            "keys": [k.decode("utf-8", "replace") for k in page],
            "total": len(keys),
            "next": nxt if nxt < len(keys) else None,
        }
