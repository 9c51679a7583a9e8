"""``Dispatcher``: turns protocol requests into ``MetaService`` calls, one at a time.

Both the RPC server loop and the embedded (in-process) transport go through it, under
its lock, so the service stays single-threaded whatever calls it. It also keeps the
window registry clients need to map other ranks (handles) and the request metrics.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from kvfabric.platform.types import Medium
from kvfabric.pool import protocol as p
from kvfabric.pool.meta import MetaService
from kvfabric.pool.metrics import PoolMetrics
from kvfabric.pool.status import Status

log = logging.getLogger("kvfabric.pool")


@dataclass(frozen=True)
class WindowInfo:
    rank: int
    medium: str
    size: int
    handle: bytes
    client: str
    pid: int = 0


class Dispatcher:
    """Serialises requests onto one :class:`MetaService` (see module docstring)."""

    def __init__(
        self,
        service: MetaService,
        epoch: int,
        table_name: str,
        table_bytes: int,
        metrics: PoolMetrics | None = None,
        extra_info: dict[str, Any] | None = None,
    ) -> None:
        self.service = service
        self.epoch = epoch
        self.lock = threading.Lock()
        self.windows: dict[tuple[int, str], WindowInfo] = {}
        self.metrics = metrics or PoolMetrics()
        self._info = {"table": table_name, "table_bytes": table_bytes, **(extra_info or {})}
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
            self._drop_dead_ranks()
            self.service.tick()
            self.metrics.update_state(self.service)

    def _drop_dead_ranks(self) -> None:
        """A rank whose owner process (on this node) exited leaves the pool at once."""
        dead = {w.rank for w in self.windows.values() if w.pid and not _alive(w.pid)}
        for rank in dead:
            removed = self.service.drop_rank(rank)
            for k in [k for k in self.windows if k[0] == rank]:
                del self.windows[k]
            log.warning("pool rank %d left (its process exited); %d object(s) dropped", rank, removed)

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
        if isinstance(req, p.AddWindow):
            medium = Medium.parse(req.medium)
            rank = req.rank if req.rank >= 0 else 1 + max((r for r, _ in s.windows), default=-1)
            if (rank, medium) not in s.windows:
                s.add_window(rank, medium, req.size)
            self.windows[(rank, medium.value)] = WindowInfo(
                rank, medium.value, req.size, req.handle, req.client, req.pid
            )
            return p.Reply(e, data={"rank": rank})
        if isinstance(req, p.DropRank):
            removed = s.drop_rank(req.rank)
            for k in [k for k in self.windows if k[0] == req.rank]:
                del self.windows[k]
            return p.Reply(e, data={"removed": removed})
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
            "windows": [w.__dict__ for w in self.windows.values()],
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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def ok_count(reply: p.Reply) -> int:
    return sum(1 for s in reply.status if s == Status.OK)
