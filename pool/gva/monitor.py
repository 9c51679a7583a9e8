"""``Monitor``: the thread that keeps a fabric's view current and removes dead ranks.

It watches the pool's membership prefix (``{ns}/m/``) from one revision to the next:

* a new membership record -> ``on_table`` (map new same-node windows, retire
  those of departed ranks, tell subscribers);
* a member whose ephemeral ``alive`` key is gone (its session ended: the process died,
  closed its store, or missed heartbeats for ``ttl`` seconds) -> ``membership.remove``.
  Every live member races to do this; compare-and-swap makes it happen once.

Events arrive in revision order and a member's alive key is written before it enters
the table, so "in the table but not alive" always means dead. A compacted watch
re-reads everything with ``range``. Between events it unmaps retired windows whose grace
has passed.

Losing the store session (``store.session_lost``: the connection closed, the lease
expired) ends the thread and reports it (``on_lost``: the fabric marks itself evicted).
Any other ``ServiceUnavailable`` (a reply that came late on a loaded machine, one failed
HTTP request to etcd) is not an eviction: the monitor waits a period and re-reads
everything; only when such failures last ``TRANSIENT_LIMIT_S`` without one success does
it give up and report the session lost. The store's own liveness (its session is what
the other ranks watch) does not depend on this thread.

The monitor knows its fabric only through the rank and token it watches for and three
callbacks (``on_table``, ``on_reap``: unmap retired windows, ``on_lost``), so it imports
nothing of ``fabric.py``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvfabric.errors import ServiceUnavailable
from kvfabric.pool.gva import membership
from kvfabric.pool.gva.rendezvous.base import Compacted, KVStore
from kvfabric.pool.gva.segments import SegmentTable, decode_record

log = logging.getLogger("kvfabric.gva")

TRANSIENT_LIMIT_S = 30.0  # store errors that are not a lost session, for this long, count as one


class Monitor(threading.Thread):
    """Membership watcher of one fabric (see module docstring)."""

    def __init__(
        self,
        rank: int,
        token: str,
        store: KVStore,
        ns: str,
        period: float,
        *,
        on_table: Callable[[SegmentTable], None],
        on_reap: Callable[[], None],
        on_lost: Callable[[ServiceUnavailable], None],
    ) -> None:
        super().__init__(name=f"kvfabric-gva-monitor-{rank}", daemon=True)
        self.rank = rank
        self.token = token
        self.on_table = on_table
        self.on_reap = on_reap
        self.on_lost = on_lost
        self.store = store
        self.ns = ns
        self.period = period
        self.stop = threading.Event()
        self._prefix = membership.member_prefix(ns)
        self._alive_prefix = membership.alive_prefix(ns)
        self._table_key = membership.table_key(ns)

    def _sync(self) -> tuple[int, bytes | None, set[str]]:
        kvs, rev = self.store.range(self._prefix)
        raw = None
        alive: set[str] = set()
        for kv in kvs:
            if kv.key == self._table_key:
                raw = kv.value
            elif kv.key.startswith(self._alive_prefix):
                alive.add(kv.key[len(self._alive_prefix) :])
        return rev, raw, alive

    def _reconcile(self, raw: bytes | None, alive: set[str]) -> None:
        rec = decode_record(raw)
        for m in rec.members:
            if m.token not in alive and m.token != self.token:
                log.warning(
                    "rank %d (pid %d on %s) is gone: removing it from the pool", m.rank, m.pid, m.node
                )
                rec = membership.remove(self.store, self.ns, m.token)
        self.on_table(SegmentTable.derive(rec))

    def run(self) -> None:
        rev, raw, alive = -1, None, set()
        need_sync = True
        failing_since: float | None = None
        while not self.stop.is_set():
            try:
                if need_sync:
                    rev, raw, alive = self._sync()
                    need_sync = False
                    self._reconcile(raw, alive)
                evs, rev = self.store.watch(self._prefix, rev, self.period)
                if self.stop.is_set():
                    return
                changed = False
                for ev in evs:
                    if ev.key == self._table_key:
                        raw, changed = ev.value, True
                    elif ev.key.startswith(self._alive_prefix):
                        tok = ev.key[len(self._alive_prefix) :]
                        if ev.value is None:
                            alive.discard(tok)
                            changed = True
                        else:
                            alive.add(tok)
                if changed:
                    self._reconcile(raw, alive)
                failing_since = None
                self.on_reap()
            except Compacted:
                need_sync = True
            except ServiceUnavailable as e:
                if self.stop.is_set():
                    return
                now = time.monotonic()
                if self.store.session_lost or now - (failing_since or now) >= TRANSIENT_LIMIT_S:
                    self.on_lost(e)
                    return
                if failing_since is None:
                    failing_since = now
                    log.warning("gva monitor of rank %d: store call failed (%s); retrying", self.rank, e)
                self.stop.wait(self.period)
                need_sync = True
            except Exception:
                log.exception("gva monitor of rank %d: unexpected error", self.rank)
                self.stop.wait(self.period)
                need_sync = True
