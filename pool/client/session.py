"""``Session``: one pool client's link to its pool, under the read and write paths.

It holds what both paths use: the transport to the meta service (``call``, which notices
a restarted service by its epoch and catches up before returning), the client's rank in
the pool's GVA fabric and its data plane (``dp``), the directory table mapped from the
service (same node only; ``read`` retries once when the service retired it), and the
objects this client's own window holds (``owned``), which it re-registers with a
restarted service (or a newly elected leader: the same path, but a fabric rank held in
etcd outlives the old service, so it is kept, not rejoined).

With replicas, other clients' puts place extents in this client's window too: a client with
a window fetches the list of committed extents its window holds (``Held``) every
``replica_sync_s`` (the pool's setting) in a thread of its own and keeps ``owned`` equal
to it (plus what its own puts added since the request left), so that after a failover
every owner re-registers every extent it holds and the new leader merges the extents of
one key into one entry. An extent committed less than ``replica_sync_s`` before the
leader died is re-registered only by its writer (when the writer's window holds it).
:class:`~kvfabric.pool.client.reads.Reader` and
:class:`~kvfabric.pool.client.writes.Writer` work over a session;
:class:`~kvfabric.pool.client.api.PoolClient` composes the three.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from kvfabric.platform.base import Platform
from kvfabric.platform.buffer import Buffer
from kvfabric.platform.checksum import Verify
from kvfabric.platform.types import Medium
from kvfabric.pool import protocol as p
from kvfabric.pool.client.dataplane import FabricDataPlane
from kvfabric.pool.client.rpc import Transport
from kvfabric.pool.gva.config import GvaConfig
from kvfabric.pool.gva.fabric import Fabric, FabricState
from kvfabric.pool.gva.rendezvous import store_options
from kvfabric.pool.status import Status
from kvfabric.pool.table import TableRetired, TableView, attach
from kvfabric.pool.windows import FixedStride

log = logging.getLogger("kvfabric.pool.client")
JOIN_VISIBLE_S = 5.0


def gva_config(info: dict[str, Any]) -> GvaConfig:
    """The fabric configuration every rank of a pool shares (from the service's Info)."""
    return GvaConfig(
        namespace=info["namespace"],
        dram_stride=info["stride"],
        hbm_stride=info["stride"],
        transports=tuple(t.strip() for t in info["transports"].split(",") if t.strip()),
        heartbeat_ttl=info.get("session_ttl_s", 10.0),
        remote_read_timeout=info.get("remote_read_timeout_s", 1.0),
        remote_suspect_time=info.get("remote_suspect_s", 5.0),
    )


class OwnedObjects:
    """The committed objects that lie in this client's own window: key -> (gva, size, gen,
    checksum). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._objects: dict[bytes, tuple[int, int, int, int]] = {}
        self._added: dict[bytes, int] = {}  # key -> ``mark`` when it was last added
        self._mark = 0

    def add(self, key: bytes, entry: tuple[int, int, int, int]) -> None:
        with self._lock:
            self._objects[key] = entry
            self._mark += 1
            self._added[key] = self._mark

    def mark(self) -> int:
        """A point in the adds, for ``replace``."""
        with self._lock:
            return self._mark

    def replace(self, listing: dict[bytes, tuple[int, int, int, int]], since: int) -> None:
        """Become ``listing`` (the service's list of this window's extents, asked for at
        ``since``), keeping what was added after ``since`` (not in the listing yet)."""
        with self._lock:
            keep = {k: self._objects[k] for k, m in self._added.items() if m > since and k in self._objects}
            self._objects = {**listing, **keep}
            self._added = {k: m for k, m in self._added.items() if m > since}

    def items(self) -> list[tuple[bytes, tuple[int, int, int, int]]]:
        with self._lock:
            return list(self._objects.items())

    def forget(self, keys: list[bytes] | None = None) -> None:
        """Forget ``keys`` (all when None): removed, or no longer ours."""
        with self._lock:
            if keys is None:
                self._objects.clear()
                self._added.clear()
            else:
                for k in keys:
                    self._objects.pop(k, None)
                    self._added.pop(k, None)

    def __len__(self) -> int:
        return len(self._objects)


@dataclass(frozen=True)
class ClientOptions:
    """How one pool client takes part (the keyword arguments of
    :class:`~kvfabric.pool.client.api.PoolClient`, whose docstring says what each means)."""

    window_bytes: int = 0
    window_medium: Medium = Medium.DRAM
    metadata_only: bool = False
    local_reads: bool = True
    client_id: str | None = None
    verify: Verify | str | bool | None = None
    token: str = ""  # the pool's shared secret: the rendezvous over TCP asks for it too
    etcd_auth: Any = None  # TLS / auth of an etcd rendezvous (rendezvous.etcd.EtcdAuth)
    replicas: int | None = None  # copies of each put (None: the pool's ``replicas``)

    def __post_init__(self) -> None:
        if self.replicas is not None:
            p.check_replicas(self.replicas)


class Session:
    """See module docstring. ``options``: how the client takes part (:class:`ClientOptions`).
    The session owns its transport (closed with it), its window and the mapped table."""

    def __init__(self, transport: Transport, platform: Platform, options: ClientOptions) -> None:
        o = options
        self.transport = transport
        self.platform = platform
        self.client_id = o.client_id or f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.options = o
        self.metadata_only = o.metadata_only
        self.local_reads = o.local_reads
        self.table: TableView | None = None
        self.fabric: Fabric | None = None
        self.dp: FabricDataPlane = None  # type: ignore[assignment]
        self.rank: int | None = None
        self.owned = OwnedObjects()
        self.closed = False
        self._window: Buffer | None = None
        self._epoch = 0
        self._restart_lock = threading.Lock()
        info = self.call(p.Info()).data
        self.addr = FixedStride(info["stride"])
        self.write_lease_s = float(info.get("write_lease_s", 10.0))
        self.verify = Verify.parse(info.get("verify", "on") if o.verify is None else o.verify)
        self.replicas = int(info.get("replicas", 1))  # the pool's default copies of a put
        self._sync_s = float(info.get("replica_sync_s", 0.0))
        self._stop = threading.Event()
        self._syncer: threading.Thread | None = None
        try:
            if not o.metadata_only:
                if o.window_bytes:
                    self._window = platform.alloc(o.window_bytes, o.window_medium, shareable=True)
                self._join(info, rank=None)
            self._attach(info)
        except BaseException:
            self.close()
            raise
        if self._window is not None and self._sync_s > 0:
            self._syncer = threading.Thread(target=self._sync_loop, name="kvfabric-pool-held", daemon=True)
            self._syncer.start()

    def _sync_loop(self) -> None:
        while not self._stop.wait(self._sync_s):
            try:
                self.sync_held()
            except Exception as e:  # noqa: BLE001 - no leader now: the next round asks again
                log.debug("listing the extents of rank %s: %s", self.rank, e)

    def sync_held(self) -> bool:
        """Make ``owned`` the service's list of the extents this window holds (see module
        docstring); False when the list was not taken (no rank, or the service changed
        meanwhile: the re-registration then went by the previous list)."""
        if self.rank is None or self._window is None or self.closed:
            return False
        epoch, since = self._epoch, self.owned.mark()
        r = self.call(p.Held(self.rank))
        if not epoch or r.epoch != epoch or r.error:
            return False
        self.owned.replace(
            {k: (g, n, gen, h) for k, g, n, gen, h in zip(r.keys, r.gvas, r.sizes, r.gens, r.sums)}, since
        )
        return True

    # ------------------------------------------------------------------ for the paths
    def call(self, req: Any) -> p.Reply:
        """One metadata RPC; a restarted service is caught up with before the reply returns."""
        reply = self.transport.call(req)
        if self._epoch and reply.epoch != self._epoch:
            with self._restart_lock:  # one catch-up, whichever thread saw the change first
                if reply.epoch != self._epoch:
                    self._on_restart(reply.epoch)
                    self._epoch = reply.epoch
            return reply
        self._epoch = reply.epoch
        return reply

    def read(self, fn: Any, *args: Any) -> Any:
        """Run a read; if the service restarted under it (table retired), catch up once."""
        try:
            return fn(*args)
        except TableRetired:
            self.refresh()
            return fn(*args)

    def refresh(self) -> None:
        """Re-read the service's state (a restart is noticed and caught up with here)."""
        self._attach(self.call(p.Info()).data)

    def require_data(self) -> None:
        if self.metadata_only:
            raise ValueError("a metadata-only pool client cannot move object bytes")
        if self.closed:
            raise ValueError("pool client is closed")

    def in_own_window(self, gva: int) -> bool:
        if self.rank is None or self._window is None:
            return False
        lo = self.addr.encode(self._window.medium, self.rank, 0)
        return lo <= gva < lo + self._window.nbytes

    # ------------------------------------------------------------------ joining
    def _rendezvous(self, info: dict[str, Any]) -> str:
        """The pool's rendezvous as this client reaches it (over TCP when its RPC is)."""
        if getattr(self.transport, "remote", False) and info.get("rendezvous_tcp"):
            return str(info["rendezvous_tcp"])
        return str(info["rendezvous"])

    def _join(self, info: dict[str, Any], rank: int | None, token: str | None = None) -> None:
        windows = {self._window.medium: self._window} if self._window is not None else {}
        url = self._rendezvous(info)
        self.fabric = Fabric.join(
            url,
            self.platform,
            windows,
            rank=rank,
            config=gva_config(info),
            token=token,
            store_options=store_options(url, self.options.token, self.options.etcd_auth),
        )
        self.rank = self.fabric.rank
        self.fabric.on_evicted(lambda why: log.info("pool rank %s left the fabric: %s", self.rank, why))
        self.dp = FabricDataPlane(self.fabric)
        self._wait_visible()

    def _wait_visible(self) -> None:
        """The service places objects in this client's window (and takes its objects back)
        only once it saw the rank join: wait for that, at most ``JOIN_VISIBLE_S``."""
        if self._window is None:
            return
        deadline = time.monotonic() + JOIN_VISIBLE_S
        while self.rank not in self.transport.call(p.Info()).data["ranks"]:
            if time.monotonic() > deadline:
                log.warning("the pool service has not seen rank %s join yet", self.rank)
                break
            time.sleep(0.01)

    def _attach(self, info: dict[str, Any]) -> None:
        """Map the service's directory table (same node only)."""
        if self.metadata_only and not self.local_reads:
            return
        if self.local_reads and (self.table is None or self.table.seg.name != info["table"]):
            old, self.table = self.table, None
            if old is not None:
                old.close()
            try:
                self.table = attach(info["table"], info["table_bytes"])
            except Exception as e:  # noqa: BLE001 - another node: no shared table, use RPC
                log.info("pool directory table not mapped (%s); reads use RPC leases", e)

    def _on_restart(self, epoch: int) -> None:
        """The meta service restarted: rejoin its fabric and re-register the objects this
        client's window holds. A client with a window reclaims its rank with its previous
        token (the restarted daemon reserved the rank for it, so a client that rejoins
        first cannot take it); if the rank went to someone else anyway its objects are
        dropped, never re-registered at addresses of another rank. The new epoch is
        recorded by the caller only after this returns, so a catch-up that fails half-way
        is tried again on the next call."""
        log.warning("pool meta service restarted (epoch %x -> %x); rejoining", self._epoch, epoch)
        info = self.transport.call(p.Info()).data
        kept = (
            self.fabric is not None
            and self.fabric.state is FabricState.JOINED
            and self._rendezvous(info).startswith("etcd://")
            and self.fabric.store.url == self._rendezvous(info)
        )
        if kept:  # a new leader of a pool whose membership lives in etcd: the rank is still ours
            self._wait_visible()
        elif self.fabric is not None:
            token = self.fabric.token
            try:
                self.fabric.leave()
            except Exception as e:  # noqa: BLE001 - its store died with the old service
                log.debug("leaving the old fabric: %s", e)
            if self._window is None:
                self._join(info, rank=None)
            else:
                try:
                    self._join(info, rank=self.rank, token=token)
                except ValueError as e:
                    log.warning(
                        "pool rank %s not reclaimed after the restart (%s); its window's objects are dropped",
                        self.rank,
                        e,
                    )
                    self.owned.forget()
                    self._join(info, rank=None)
        items = self.owned.items()
        if items:
            keys = [k for k, _ in items]
            gv, sz, gn, sm = zip(*(v for _, v in items))
            reply = self.transport.call(p.Reregister(keys, list(gv), list(sz), list(gn), list(sm)))
            # what the service refused (its extent went to another object, another entry
            # holds the key, no room) is no longer ours to name: kept, a later restart
            # would re-register it over whatever then lies in that extent
            refused = [k for k, st in zip(keys, reply.status) if st != Status.OK]
            if refused:
                log.warning("pool meta service refused %d re-registered object(s); forgotten", len(refused))
                self.owned.forget(refused)
        self._attach(info)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Leave the fabric (the service then drops this rank's objects) and release
        the window and the table. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        if self._syncer is not None and self._syncer is not threading.current_thread():
            self._syncer.join(5)
        if self.fabric is not None:
            try:
                self.fabric.leave()
            except Exception as e:  # noqa: BLE001 - closing: the service may be gone
                log.debug("leaving the pool fabric: %s", e)
        if self._window is not None and not self._window.freed:
            self.platform.free(self._window)
        if self.table is not None:
            self.table.close()
        self.transport.close()
