"""``PoolNode``: the service side of a pool on one node, and ``EmbeddedPool``.

A node owns the directory table (shared memory), the meta service and its dispatcher,
the pool's rendezvous store (a single-node server unless ``config.rendezvous`` names one),
and its rank in the pool's GVA fabric: rank 0, with a DRAM window of its own unless
``config.dram`` is 0. Every client joins the same fabric; the node follows its segment
table (joins, leaves, deaths) into the directory. The daemon (``daemon.py``) serves the
node over RPC; ``EmbeddedPool`` serves it in-process (nothing to start), with a thread
that expires leases.

Leadership (``leader_election``: meta services on several nodes, one pool, etcd as the
rendezvous): every node joins the pool's fabric (at any free rank, since rank 0 is no
one's in particular then) and follows its membership, but serves requests only while its
:class:`~kvfabric.pool.service.leader.Campaign` leads (the dispatcher's gate). Elected, it
starts from an empty directory under a new epoch, so clients notice the change and
re-register what their windows hold (the restart path), and it holds allocations back
for ``write_lease_s`` (writers the previous leader let in may still be copying); deposed,
it empties its directory again. ``start_election(port)`` starts the campaign once the
daemon's TCP RPC listener is bound (its address is what the leader key tells clients).
"""

from __future__ import annotations

import enum
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from kvfabric.errors import HandleError
from kvfabric.platform import shm
from kvfabric.platform.base import Platform
from kvfabric.platform.buffer import Buffer
from kvfabric.platform.registry import create as create_platform
from kvfabric.platform.types import Medium
from kvfabric.pool import table as tbl
from kvfabric.pool.client.api import PoolClient
from kvfabric.pool.client.session import gva_config
from kvfabric.pool.config import PoolConfig
from kvfabric.pool.gva import membership
from kvfabric.pool.gva.fabric import Fabric, MembershipChange
from kvfabric.pool.gva.rendezvous import store_options
from kvfabric.pool.gva.rendezvous.server import RendezvousServer
from kvfabric.pool.gva.segments import Reservation, SegmentTable
from kvfabric.pool.service.adopt import adopt_old_tables
from kvfabric.pool.service.dispatch import Dispatcher
from kvfabric.pool.service.events import EventQueue, KvEventPublisher
from kvfabric.pool.service.leader import Campaign, LeaderState
from kvfabric.pool.service.local import LocalTransport
from kvfabric.pool.service.meta import MetaService
from kvfabric.pool.service.prefix import PrefixQuery
from kvfabric.pool.windows import FixedStride

log = logging.getLogger("kvfabric.pool")

RECLAIM_GRACE_S = 600.0  # a rank with a window stays reserved this long after a restart


class StartStage(enum.Enum):
    """The stages of a daemon's start-up, in order (``PoolDaemon`` runs the first and the
    last two, ``PoolNode`` the others). The start calls its checkpoint after each; a start
    that stops at any of them (a signal, an error) leaves no segment it created behind."""

    LOCKED = "locked"  # the socket and pool-name locks are held; nothing allocated yet
    WINDOW = "window"  # the named DRAM window exists
    TABLE = "table"  # the directory table exists
    RENDEZVOUS = "rendezvous"  # the pool's rendezvous store serves
    PRETOUCH = "pretouch"  # after each 64 MiB of the window faulted in
    FABRIC = "fabric"  # rank 0 joined; ranks of the previous run reserved
    ADOPTED = "adopted"  # old directory tables retired, own objects rebuilt
    RPC = "rpc"  # RPC listens
    HTTP = "http"  # the HTTP endpoint listens (or none is configured)


Checkpoint = Callable[[StartStage], None]


def _no_checkpoint(stage: StartStage) -> None:
    pass


class _RanksFile(msgspec.Struct, frozen=True):
    """``<socket>.ranks``: the ranks with windows, kept current while the daemon runs, so
    the next start can reserve them for their owners (``until`` 0: from that start on)."""

    pool: str
    ranks: tuple[Reservation, ...] = ()


class PoolNode:
    """See module docstring. ``close()`` leaves the fabric and releases the rendezvous
    server, the table, the window and the platform (if the node created it).

    Persistent nodes (the daemon's): the window and the table are named segments. A start
    that fails (``serving`` still False at ``close()``) removes the segments it created
    and leaves those it found (a crashed daemon's window, and its table until this start
    rebuilt from it), so the next start finds the pool as this one did; a stop after
    serving removes both. ``checkpoint`` is called after each :class:`StartStage`; it may
    raise to abandon the start (the daemon's signal handling does)."""

    def __init__(
        self,
        config: PoolConfig | None = None,
        platform: Platform | None = None,
        persistent: bool = False,
        checkpoint: Checkpoint | None = None,
    ) -> None:
        self.config = config or PoolConfig()
        self.persistent = persistent
        self.serving = not persistent  # the daemon sets it once its whole start succeeded
        self._own_platform = platform is None
        self.addressing = FixedStride()
        self._closed = False
        self._stage = checkpoint or _no_checkpoint
        self.window: Buffer | None = None
        self.table: tbl.TableView | None = None
        self.rdv: RendezvousServer | None = None
        self.fabric: Fabric | None = None
        self.events: KvEventPublisher | None = None  # KV events (kv_events_endpoint)
        self._tmpdir: str | None = None
        self._window_found = False  # the named window existed before this start
        self._tables_adopted = False  # the old tables are gone: the new one holds the pool
        self._reserved: dict[int, Reservation] = {}
        self._ranks_lock = threading.Lock()
        self.rebuilt = 0
        self.campaign: Campaign | None = None
        self.platform = platform or create_platform()
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        if self.persistent and self.config.dram:
            try:
                with shm.hugepages_for(self.config.hugepages or None):
                    self.window, created = self.platform.alloc_named(self._name("window"), self.config.dram)
            except HandleError as e:
                path = os.path.join(shm.shm_dir(), shm.NAMED + self._name("window"))
                raise HandleError(
                    f"pool {self.config.name!r}: {e}; it is the window of an earlier daemon of this pool: "
                    f"start with that dram size to recover its objects, or delete {path}"
                ) from e
            self._window_found = not created
            self._stage(StartStage.WINDOW)
        epoch = int.from_bytes(os.urandom(8), "little") | 1
        self.table = tbl.create(
            self.config.max_objects, name=self._name(f"table.{epoch:016x}") if self.persistent else None
        )
        self._stage(StartStage.TABLE)
        self.service = MetaService(self.config, self.table, self.addressing)
        url = self.config.rendezvous or self._start_rendezvous()
        tcp_url = self.rdv.tcp_url if self.rdv is not None and self.rdv.tcp else ""
        self._stage(StartStage.RENDEZVOUS)
        self.dispatcher = Dispatcher(
            self.service,
            self.table.epoch,
            {
                "table": self.table.seg.name,
                "table_bytes": self.table.seg.nbytes,
                "name": self.config.name,
                "platform": self.platform.name,
                "stride": self.addressing.stride,
                "rendezvous": url,
                "rendezvous_tcp": tcp_url,  # for clients over TCP ('' -> rendezvous)
                "namespace": f"kvfabric/pool/{self.config.name}",
                "transports": self.config.transports,
                "session_ttl_s": self.config.session_ttl_s,
                "remote_read_timeout_s": self.config.remote_read_timeout_s,
                "remote_suspect_s": self.config.remote_suspect_s,
            },
        )
        if self.config.dram:
            if self.window is None:
                with shm.hugepages_for(self.config.hugepages or None):
                    self.window = self.platform.alloc(self.config.dram, Medium.DRAM, shareable=True)
            if self.config.pretouch and not self._window_found:
                _pretouch(self.window, lambda: self._stage(StartStage.PRETOUCH))
        windows: dict[Medium, Any] = {Medium.DRAM: self.window} if self.window is not None else {}
        elected = self.config.leader_election
        self.fabric = Fabric.join(
            url,
            self.platform,
            windows,
            rank=None if elected else 0,
            config=gva_config(self.dispatcher.info()),
            store_options=store_options(url, self.config.token, self.config.etcd_auth),
        )
        self.fabric.subscribe(self._on_change)
        self.dispatcher.apply_table(self.fabric.table)
        if elected:
            self.dispatcher.gate = lambda: "this meta service stands by"  # until start_election
        if self.persistent and not elected:  # with etcd, ranks outlive this daemon there
            self._reserve_ranks()
        self._stage(StartStage.FABRIC)
        if self.persistent:
            with self.dispatcher.lock:
                self.rebuilt = adopt_old_tables(
                    self.service,
                    self._name("table."),
                    self.table.seg.name,
                    rebuild=self._window_found,
                    rank=self.fabric.rank,
                )
            self._tables_adopted = True
        self._stage(StartStage.ADOPTED)
        if self.config.kv_events_endpoint:
            self._start_events()

    def _start_events(self) -> None:
        """The KV event publisher (``service/events.py``): its first batches are the
        directory as it is now; the service reports every change after that."""
        assert self.fabric is not None and self.table is not None

        def install(queue: EventQueue | None) -> None:
            self.service.events = queue  # the service of now (a new leader starts a new one)

        self.events = KvEventPublisher(
            self.config,
            self.dispatcher.lock,
            self.table,
            install,
            self.addressing.decode,
            self.node_of,
            self.fabric.node,
        )
        self.events.start()
        self.dispatcher.metrics.kv_events.source = self.events.metrics

    def node_of(self, rank: int) -> str | None:
        """The node pool rank ``rank`` runs on now (None: no such member)."""
        fabric = self.fabric
        if fabric is None:
            return None
        return next((m.node for m in fabric.table.members if m.rank == rank), None)

    def prefix_query(self) -> PrefixQuery:
        """What answers the HTTP endpoint's ``POST /prefix`` (``service/prefix.py``)."""
        assert self.fabric is not None and self.table is not None
        return PrefixQuery(self.table, self.addressing.decode, self.node_of, self.fabric.node)

    def _name(self, what: str) -> str:
        return f"pool-{self.config.name}-{what}"

    def _start_rendezvous(self) -> str:
        """The pool's single-node rendezvous store: TCP when the pool serves other nodes,
        else a Unix socket beside the RPC socket (or in a private directory, embedded)."""
        tcp = self.config.tcp_addr
        if self.persistent:
            path = self.config.socket + ".rdv"
            if os.path.exists(path):
                os.unlink(path)  # the daemon checked that no live daemon owns this pool
        else:
            self._tmpdir = tempfile.mkdtemp(prefix="kvfabric-pool-")
            path = os.path.join(self._tmpdir, "rdv.sock")
        self.rdv = RendezvousServer(
            tcp[0] if tcp is not None else "127.0.0.1",
            0,
            unix_path=path,
            tcp=tcp is not None,
            token=self.config.token,
            insecure=self.config.insecure,
            session_ttl=self.config.session_ttl_s,
        ).start()
        return self.rdv.url

    # ------------------------------------------------------------------ leadership
    def start_election(self, tcp_port: int) -> Campaign:
        """Campaign for the pool's leadership (``leader_election``), advertising this
        node's TCP RPC listener (bound at ``tcp_port``) in the leader key. Standing by
        until elected; see the module docstring for what election and deposition do."""
        from kvfabric.pool.client.leader import LeaderRecord
        from kvfabric.pool.gva.rendezvous.etcd import EtcdStore
        from kvfabric.pool.service.leader import Campaign

        if not self.config.leader_election or self.fabric is None:
            raise ValueError("start_election needs pool config leader_election (and a started node)")
        if self.campaign is not None:
            raise ValueError("start_election called twice")
        host, port = _host_port_of(self.config.advertised)
        record = LeaderRecord(f"{host}:{port or tcp_port}", os.getpid(), self.fabric.node, time.time())
        ttl = self.config.leader_ttl_s
        store = EtcdStore(self.config.rendezvous, call_timeout=max(0.5, ttl / 4), auth=self.config.etcd_auth)
        campaign = Campaign(store, self.config.name, record.encode(), ttl, self._on_elected, self._on_deposed)
        self.campaign = campaign
        self.dispatcher.leader_info = lambda: _leader_fields(campaign)
        self.dispatcher.gate = lambda: None if campaign.may_grant() else _why_not(campaign)
        return campaign.start()

    def _on_elected(self) -> None:
        with self.dispatcher.lock:
            self._fresh_directory()
            self.dispatcher.hold_allocs_until = time.monotonic() + self.config.write_lease_s

    def _on_deposed(self, reason: str) -> None:
        with self.dispatcher.lock:
            self._fresh_directory()

    def _fresh_directory(self) -> None:
        """An empty directory under a new epoch (call under the dispatcher's lock): every
        entry leaves the table (on-node readers see each go), the service starts over on the
        fabric's windows, and clients that see the new epoch re-register their objects."""
        assert self.table is not None and self.fabric is not None
        old = self.service
        old.remove_all()  # the readable objects, as a removal would (KV events see them go)
        writer, hashes = old.table, self.table.slots["hash"]
        while (left := np.flatnonzero(hashes != 0)).size:  # a removal shifts its cluster back:
            for slot in left.tolist():  # an entry may land on a slot this pass already cleared
                if hashes[slot] != 0:
                    writer.remove(int(slot))
        epoch = int.from_bytes(os.urandom(8), "little") | 1
        writer.set_epoch(epoch)
        self.service = MetaService(self.config, self.table, self.addressing)
        if getattr(old, "events", None) is not None:  # hooks installed on the service carry over
            self.service.events = old.events  # type: ignore[attr-defined]
        self.dispatcher.service = self.service
        self.dispatcher.epoch = epoch
        table = self.fabric.table
        want = {(seg.rank, seg.medium): seg.nbytes for seg in table.segments}
        for (rank, medium), size in want.items():
            self.service.add_window(rank, medium, size)

    # ------------------------------------------------------------------ ranks across restarts
    def _ranks_path(self) -> str:
        return self.config.socket + ".ranks"

    def _on_change(self, change: MembershipChange) -> None:
        self.dispatcher.apply_table(change.new)
        if self.persistent:
            self._save_ranks(change.new)

    def _reserve_ranks(self) -> None:
        """Reserve, for their owners, the ranks that had windows when the previous daemon
        of this socket last saw them (``<socket>.ranks``): their objects' addresses carry
        those ranks, and a client that rejoins first must not take one. Owners on this node
        whose process is gone are skipped; the others lapse after ``RECLAIM_GRACE_S``."""
        assert self.fabric is not None
        path = self._ranks_path()
        try:
            with open(path, "rb") as f:
                saved = msgspec.json.decode(f.read(), type=_RanksFile)
        except FileNotFoundError:
            saved = _RanksFile(self.config.name)
        except (OSError, msgspec.DecodeError) as e:
            log.warning("ignoring the unreadable rank file %s: %s", path, e)
            saved = _RanksFile(self.config.name)
        now = time.time()
        keep = []
        for r in saved.ranks if saved.pool == self.config.name else ():
            until = r.until or now + RECLAIM_GRACE_S
            if r.rank <= 0 or until <= now or (r.node == self.fabric.node and not shm.process_alive(r.pid)):
                continue
            keep.append(Reservation(r.rank, r.digest, until, r.node, r.pid))
        with self._ranks_lock:
            self._reserved = {r.rank: r for r in keep}
        if keep:
            membership.reserve(self.fabric.store, self.fabric.config.namespace, keep)
            log.info(
                "pool %r: rank(s) %s reserved for their owners until they rejoin",
                self.config.name,
                ", ".join(str(r.rank) for r in keep),
            )
        self._save_ranks(self.fabric.table)

    def _save_ranks(self, table: SegmentTable) -> None:
        """Write the ranks with windows (and the reservations not yet reclaimed) to
        ``<socket>.ranks``, atomically (rename)."""
        members = {
            m.rank: Reservation(m.rank, membership.token_digest(m.token), 0.0, m.node, m.pid)
            for m in table.members
            if m.rank > 0 and m.windows
        }
        now = time.time()
        with self._ranks_lock:
            for rank in members:
                self._reserved.pop(rank, None)  # reclaimed: the member record supersedes it
            waiting = [r for r in self._reserved.values() if r.until > now]
            ranks = tuple(sorted([*members.values(), *waiting], key=lambda r: r.rank))
            path = self._ranks_path()
            tmp = f"{path}.{os.getpid()}.tmp"
            try:
                with open(tmp, "wb") as f:
                    f.write(msgspec.json.encode(_RanksFile(self.config.name, ranks)))
                os.replace(tmp, path)
            except OSError as e:
                log.warning("could not record the pool's ranks in %s: %s", path, e)

    def client(self, **kwargs: Any) -> PoolClient:
        """An in-process client (calls go straight to the dispatcher; it joins the fabric)."""
        return PoolClient(LocalTransport(self.dispatcher), self.platform, **kwargs)

    def close(self) -> None:
        """Release everything the node holds (see the class docstring for which named
        segments a failed start keeps). Idempotent; safe on a half-built node."""
        if self._closed:
            return
        self._closed = True
        if self.campaign is not None:
            self.campaign.stop()  # a leader gives the key up now, so a standby takes over
        keep_window = self.persistent and not self.serving and self._window_found
        keep_table = keep_window and self._tables_adopted
        if self.events is not None:
            self.events.stop()
        if self.fabric is not None:
            self.fabric.leave()
        if self.rdv is not None:
            self.rdv.close()
        if self._tmpdir is not None:
            import shutil

            shutil.rmtree(self._tmpdir, ignore_errors=True)
        if self.window is not None and not self.window.freed:
            self.platform.free(self.window)
            if self.persistent and not keep_window:
                self.platform.unlink_named(self._name("window"))
        if self.table is not None:
            seg = self.table.seg
            self.table.close()
            if seg.owner:
                seg.unlink()
            elif not keep_table:
                shm.unlink_named(seg.name[len(shm.NAMED) :])
        if self._own_platform:
            self.platform.close()


def _host_port_of(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host, int(port)


def _why_not(campaign: Campaign) -> str:
    st = campaign.status()
    if st.state is LeaderState.LEADER:
        return "its etcd lease may have run out (it grants nothing until it is renewed)"
    return f"this meta service is {st.state.value}" + (f"; the leader is at {st.leader}" if st.leader else "")


def _leader_fields(campaign: Campaign) -> dict[str, Any]:
    st = campaign.status()
    return {
        "leader": {
            "state": st.state.value,
            "leader": st.leader,
            "terms": st.terms,
            "grant_s_left": st.grant_s_left,
        }
    }


def _pretouch(buf: Buffer, step_done: Callable[[], None]) -> None:
    """Fault the window's pages in once now, not on the first puts (first touch of fresh
    shared memory runs below 1 GB/s). ``step_done`` after each 64 MiB (a checkpoint)."""
    t0 = time.perf_counter()
    view = buf.numpy()
    step = 64 << 20
    for off in range(0, buf.nbytes, step):
        view[off : off + step] = 0
        step_done()
    log.info("pre-touched the %d MiB DRAM window in %.2f s", buf.nbytes >> 20, time.perf_counter() - t0)


class EmbeddedPool(PoolNode):
    """A whole pool inside one process (see module docstring)."""

    def __init__(self, config: PoolConfig | None = None, platform: Platform | None = None) -> None:
        super().__init__(config, platform)
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="kvfabric-pool-tick", daemon=True)
        self._ticker.start()

    def _tick(self) -> None:
        while not self._stop.wait(0.1):
            self.dispatcher.tick()

    def close(self) -> None:
        if hasattr(self, "_stop"):
            self._stop.set()
            self._ticker.join(2)
        super().close()

    def __enter__(self) -> EmbeddedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
