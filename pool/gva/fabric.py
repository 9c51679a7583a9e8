"""``Fabric``: this process as one rank of a GVA pool: join, map, resolve, copy, leave.

Call order::

    fab = Fabric.join(store_url_or_KVStore, platform, {Medium.DRAM: 1 << 30}, config=cfg)
    fab.table / fab.version / fab.rank           # the current SegmentTable and who we are
    fab.window(Medium.DRAM)                      # this rank's window (a platform Buffer)
    fab.gva(Medium.DRAM, offset, rank=None)      # a GVA (checked against the window size)
    fab.resolve(gva, n) -> Span                  # fast path: no RPC, no copy (mapped ranks)
    fab.local_address(gva, n) -> int             # the same as a plain address
    fab.xcopy(dst, src, n) -> XferHandle         # async; xcopy_sync raises on failure
    fab.batch_xcopy(items) -> XferHandle         # many pieces; batch_xcopy_sync
    fab.subscribe(fn)                            # fn(MembershipChange) on join/leave/death
    fab.leave()                                  # also close() / context manager

Windows: ``windows`` maps a medium to a size (the fabric allocates a shareable buffer
and frees it at leave) or to a caller's shareable ``Buffer`` (the caller keeps owning
it). A rank may join with no window at all (a metadata-only client): it still maps and
copies other ranks' windows. Same-node windows (equal ``GvaConfig.node``) are mapped
with ``Platform.import_handle`` as the table announces them.

Fast path for the pool: ``resolve``/``local_address`` decode with integer arithmetic
against the installed view (one attribute read, a divmod, a list index) and return the
mapped address; nothing is allocated but the returned ``Span``. A rank that is not
mapped here raises ``RankUnavailable``; an out-of-window range ``ValueError``. For the
lowest latency on host memory, pair ``local_address`` with a plain memmove
(``ctypes.memmove`` or ``platform.native``): ``Platform.copy`` adds a few microseconds
of argument checks, ``xcopy_sync`` a few more (window and version checks).

Failure: a rank that dies is removed from the table by the survivors when its store
session ends: at once with the single-node store when the process is killed (its socket
closes), after the session ttl and a probe's grace when it is stopped or hung, never while
its process still runs on this node up to the store's ``max_silence`` (docs/gva.md,
"Liveness"); with etcd, when its lease lapses. Copies naming it then fail fast with
``RankUnavailable`` and copies among the others continue. If this process loses its own
session, ``state`` becomes ``EVICTED`` and every copy raises ``RankUnavailable``.

Ownership: an ``XferHandle`` must be waited (or checked until done) for the windows it
used to be unmapped after their owner left. Not fork-safe: join in the final process.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvfabric.errors import KVFabricError, RankUnavailable
from kvfabric.platform.base import Platform
from kvfabric.platform.buffer import Buffer
from kvfabric.platform.registry import create
from kvfabric.platform.types import Medium, Span
from kvfabric.pool.gva import membership
from kvfabric.pool.gva.address import AddressSpace, Gva
from kvfabric.pool.gva.config import GvaConfig
from kvfabric.pool.gva.copies import Copier, Items
from kvfabric.pool.gva.handle import XferHandle
from kvfabric.pool.gva.monitor import Monitor
from kvfabric.pool.gva.rendezvous import connect
from kvfabric.pool.gva.rendezvous.base import KVStore
from kvfabric.pool.gva.segments import MemberRecord, SegmentTable
from kvfabric.pool.gva.transports import Transport, TransportContext, build
from kvfabric.pool.gva.view import MappedWindow, View
from kvfabric.pool.gva.windows import map_table, prepare

log = logging.getLogger("kvfabric.gva")


class FabricState(enum.Enum):
    JOINED = "joined"
    LEFT = "left"
    EVICTED = "evicted"  # the store session was lost; this rank is no longer a member


@dataclass(frozen=True)
class MembershipChange:
    """What a subscriber is told: the tables before and after, who came and went."""

    old: SegmentTable
    new: SegmentTable
    joined: tuple[int, ...]
    left: tuple[int, ...]


class Fabric:
    """One rank of a GVA pool (see module docstring). Membership is kept here; copies and
    address resolution are its :class:`~kvfabric.pool.gva.copies.Copier`'s (``copier``)."""

    def __init__(self, platform: Platform, store: KVStore, config: GvaConfig) -> None:
        self.platform, self.store, self.config = platform, store, config
        self.token = uuid.uuid4().hex
        self.node = config.node
        self.rank = -1
        self.state = FabricState.JOINED
        self._owned_platform = self._owned_store = False
        self._windows: dict[Medium, Buffer] = {}
        self._owned_windows: list[Buffer] = []
        self._maps: dict[tuple[str, Medium], MappedWindow] = {}
        self._retired: list[MappedWindow] = []
        self._transports: dict[str, Transport] = {}
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._subs: list[Callable[[MembershipChange], None]] = []
        self._on_evicted: list[Callable[[str], None]] = []
        empty = View(SegmentTable.derive(membership.MembershipRecord()), -1, {})
        self.copier = Copier(config, platform, self._transports, empty, self._check_member)
        self._monitor: Monitor | None = None
        self._evicted_reason = ""

    # ------------------------------------------------------------------ join / leave
    @classmethod
    def join(
        cls,
        store: KVStore | str,
        platform: Platform | str | None = None,
        windows: Mapping[Medium | str, int | Buffer] | None = None,
        *,
        rank: int | None = None,
        config: GvaConfig | None = None,
        token: str | None = None,
        store_options: Mapping[str, Any] | None = None,
    ) -> Fabric:
        """Join the pool at ``store`` (a ``KVStore`` or its url) contributing ``windows``.
        ``token``: join as this incarnation token (a previous one of this process, to
        reclaim the rank reserved for it after the store restarted); default a new one.
        ``store_options``: passed to the store opened from a url (``rendezvous.connect``:
        ``token`` of a ``kvf://`` server, ``auth`` of etcd)."""
        cfg = config or GvaConfig()
        if not isinstance(cfg, GvaConfig):
            raise TypeError(f"config must be a GvaConfig, got {type(cfg).__name__}")
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
            raise ValueError(f"rank must be an int >= 0 or None, got {rank!r}")
        if not isinstance(store, (str, KVStore)):
            raise TypeError(f"store must be a KVStore or a url, got {type(store).__name__}")
        if platform is not None and not isinstance(platform, (str, Platform)):
            raise TypeError(f"platform must be a Platform, a name or None, got {type(platform).__name__}")
        owned_store = isinstance(store, str)
        if isinstance(store, str):
            opts = dict(store_options or {})
            if store.startswith("etcd://"):
                opts.setdefault("ttl", cfg.heartbeat_ttl)
            st = connect(store, **opts)
        else:
            st = store
        try:
            plat = platform if isinstance(platform, Platform) else create(platform)
        except BaseException:
            if owned_store:
                st.close()
            raise
        fab = cls(plat, st, cfg)
        if token is not None:
            fab.token = token
        fab._owned_platform = platform is None or isinstance(platform, str)
        fab._owned_store = owned_store
        try:
            fab._join(windows or {}, rank)
        except BaseException:
            fab.state = FabricState.LEFT
            fab._retire_self()  # a join that got half-way leaves no member record behind
            fab._teardown()
            raise
        return fab

    def _join(self, windows: Mapping[Medium | str, int | Buffer], rank: int | None) -> None:
        cfg, plat = self.config, self.platform
        self._windows, records = prepare(plat, windows, self._owned_windows)
        ctx = TransportContext(plat, cfg, -1, self.node)
        names = list(dict.fromkeys([*cfg.transports, *(t for r in cfg.pair_rules for t in r.transports)]))
        routes: dict[str, str] = {}
        for name in names:
            t = build(name, ctx)
            self._transports[name] = t
            routes.update(t.routes())
            for buf in self._windows.values():
                t.register_window(buf)
        me = MemberRecord(-1, self.token, self.node, os.getpid(), plat.name, 0, tuple(records), routes)
        pinned = AddressSpace(cfg.dram_stride, cfg.hbm_stride)
        ns = cfg.namespace
        self.store.set(membership.alive_key(ns, self.token), str(os.getpid()).encode(), ephemeral=True)
        rec = membership.update(self.store, ns, lambda r: membership.with_member(r, me, rank, pinned))
        self.rank = next(m.rank for m in rec.members if m.token == self.token)
        for t in self._transports.values():
            t.ctx = TransportContext(plat, cfg, self.rank, self.node)
        self._install(SegmentTable.derive(rec))
        period = max(min(1.0, cfg.unmap_grace / 2 or 1.0), 0.05)
        self._monitor = Monitor(
            self.rank,
            self.token,
            self.store,
            ns,
            period,
            on_table=self._install,
            on_reap=self._reap,
            on_lost=self._session_lost,
        )
        self._monitor.start()
        log.info("rank %d joined %r on %s (segment table v%d)", self.rank, ns, self.node, self.table.version)
        log.debug("%s", self.table.describe())

    def leave(self) -> None:
        """Leave the pool: retire this rank's windows, unmap the others'. Idempotent."""
        with self._lock:
            if self.state is FabricState.LEFT:
                return
            was_member = self.state is FabricState.JOINED and self.rank >= 0
            self.state = FabricState.LEFT
        if self._monitor is not None:
            self._monitor.stop.set()
        if was_member:
            self._retire_self()
        self._teardown()

    def _retire_self(self) -> None:
        try:
            membership.remove(self.store, self.config.namespace, self.token)
            self.store.delete(membership.alive_key(self.config.namespace, self.token))
        except KVFabricError as e:
            log.warning("rank %d: could not retire itself cleanly: %s", self.rank, e)

    close = leave

    def _teardown(self) -> None:
        if self._monitor is not None:
            self._monitor.stop.set()
        for t in self._transports.values():
            try:
                t.close()
            except Exception as e:  # noqa: BLE001 - shutting down: report, go on
                log.warning("closing transport %s: %s", t.name, e)
        self._transports.clear()
        if self._owned_store:
            self.store.close()
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(10)
        with self._lock:
            maps = list(self._maps.values()) + self._retired
            self._maps.clear()
            self._retired.clear()
            self.copier.view = View(self.copier.view.table, self.rank, {})
        for m in maps:
            if not m.buffer.freed:
                self.platform.free(m.buffer)
        for buf in self._owned_windows:
            if not buf.freed:
                self.platform.free(buf)
        self._owned_windows.clear()
        if self._owned_platform:
            self.platform.close()

    def __enter__(self) -> Fabric:
        return self

    def __exit__(self, *exc: object) -> None:
        self.leave()

    # ------------------------------------------------------------------ view maintenance
    def _install(self, table: SegmentTable) -> None:
        with self._lock:
            old = self.copier.view.table
            if self.state is not FabricState.JOINED or (
                table.version <= old.version and self.copier.view.rank >= 0
            ):
                return
            ends, retired = map_table(
                table,
                self.platform,
                token=self.token,
                node=self.node,
                rank=self.rank,
                own=self._windows,
                maps=self._maps,
                can_map="mapped" in self._transports,
            )
            self._retired.extend(retired)
            view = self.copier.view = View(table, self.rank, ends)
            for t in self._transports.values():
                t.update(view)
            if self.rank >= 0 and all(m.token != self.token for m in table.members):
                self.state = FabricState.EVICTED
                self._evicted_reason = f"removed from the pool at table v{table.version}"
            self._cond.notify_all()
            subs = list(self._subs)
        if subs:
            change = MembershipChange(
                old,
                table,
                tuple(sorted(set(table.ranks) - set(old.ranks))),
                tuple(sorted(set(old.ranks) - set(table.ranks))),
            )
            for fn in subs:
                try:
                    fn(change)
                except Exception:
                    log.exception("gva membership subscriber failed")

    def _reap(self) -> None:
        """Unmap retired windows whose grace has passed and that no copy pins."""
        now = time.monotonic()
        free = []
        with self._lock:
            keep = []
            for m in self._retired:
                with m.lock:
                    if (
                        m.pins == 0
                        and m.retired_at is not None
                        and now - m.retired_at >= self.config.unmap_grace
                    ):
                        free.append(m)
                        continue
                keep.append(m)
            self._retired = keep
        for m in free:
            if not m.buffer.freed:
                self.platform.free(m.buffer)

    def _session_lost(self, err: BaseException) -> None:
        with self._lock:
            evicted = self.state is FabricState.JOINED
            if evicted:
                self.state = FabricState.EVICTED
                self._evicted_reason = f"rendezvous session lost: {err}"
            handlers = list(self._on_evicted)
            self._cond.notify_all()
        if not evicted:
            return
        if not handlers:
            log.error("rank %d evicted: %s", self.rank, err)
        for fn in handlers:
            fn(self._evicted_reason)

    def on_evicted(self, fn: Callable[[str], None]) -> None:
        """Call ``fn(reason)`` instead of logging an error when this rank loses its session
        (an owner that reports the failure itself, e.g. a pool client, registers one)."""
        with self._lock:
            self._on_evicted.append(fn)

    # ------------------------------------------------------------------ queries
    @property
    def table(self) -> SegmentTable:
        return self.copier.view.table

    @property
    def version(self) -> int:
        return self.copier.view.table.version

    def window(self, medium: Medium | str) -> Buffer:
        """This rank's window of ``medium`` (``ValueError`` if it contributes none)."""
        med = Medium.parse(medium)
        buf = self._windows.get(med)
        if buf is None:
            raise ValueError(f"rank {self.rank} contributes no {med.value} window")
        return buf

    def gva(self, medium: Medium | str, offset: int = 0, rank: int | None = None) -> Gva:
        """The GVA of ``offset`` in ``rank``'s (default: this rank's) ``medium`` window."""
        return self.copier.view.table.gva(Medium.parse(medium), self.rank if rank is None else rank, offset)

    def transport(self, name: str) -> Transport:
        """The enabled transport ``name`` (e.g. to reach the remote engine directly)."""
        t = self._transports.get(name)
        if t is None:
            raise ValueError(
                f"transport {name!r} is not enabled here (enabled: {', '.join(self._transports)})"
            )
        return t

    def subscribe(self, fn: Callable[[MembershipChange], None]) -> Callable[[], None]:
        """Call ``fn`` (on the monitor thread) after every membership change; returns an
        unsubscribe function. ``change.left`` lists ranks that left or died."""
        with self._lock:
            self._subs.append(fn)
        return lambda: self._subs.remove(fn) if fn in self._subs else None

    def wait_for(self, predicate: Callable[[SegmentTable], bool], timeout: float = 30.0) -> SegmentTable:
        """Block until ``predicate(table)`` holds; ``TimeoutError`` naming the table if not."""
        with self._cond:
            if not self._cond.wait_for(
                lambda: predicate(self.copier.view.table) or self.state is not FabricState.JOINED, timeout
            ):
                raise TimeoutError(
                    f"rank {self.rank}: condition not met within {timeout} s; {self.table.describe()}"
                )
            self._check_member()
            return self.copier.view.table

    def wait_for_version(self, version: int, timeout: float = 30.0) -> SegmentTable:
        return self.wait_for(lambda t: t.version >= version, timeout)

    # ------------------------------------------------------------------ copies (the copier's)
    def local_address(self, gva: int, nbytes: int) -> int:
        """The address in this process of ``[gva, gva + nbytes)`` (mapped ranks only)."""
        return self.copier.local_address(gva, nbytes)

    def resolve(self, gva: int, nbytes: int) -> Span:
        """A platform ``Span`` of ``[gva, gva + nbytes)`` in this process (mapped ranks only)."""
        return self.copier.resolve(gva, nbytes)

    def xcopy(
        self, dst: Any, src: Any, nbytes: int | None = None, *, version: int | None = None
    ) -> XferHandle:
        """Copy ``nbytes`` from ``src`` to ``dst`` (GVAs or local memory); asynchronous."""
        return self.copier.xcopy(dst, src, nbytes, version)

    def xcopy_sync(
        self, dst: Any, src: Any, nbytes: int | None = None, *, version: int | None = None
    ) -> None:
        """``xcopy`` that returns once the bytes are in place; ``TransferFailed`` if not."""
        self.copier.xcopy_sync(dst, src, nbytes, version)

    def batch_xcopy(self, items: Items, *, version: int | None = None, inline: bool = False) -> XferHandle:
        """Copy many ``(dst, src, nbytes)`` pieces; grouped by rank pair; asynchronous.

        ``inline``: run the copies in the calling thread and return a finished handle
        (per-item statuses, nothing raised): the cheapest way when the caller would wait
        at once anyway."""
        return self.copier.batch_xcopy(items, version, inline)

    def batch_xcopy_sync(self, items: Items, *, version: int | None = None) -> None:
        """``batch_xcopy`` that returns when every piece is in place; raises if any failed."""
        self.copier.batch_xcopy(items, version, True).raise_for_status()

    def _check_member(self) -> None:
        if self.state is not FabricState.JOINED:
            reason = self._evicted_reason or "it left the pool"
            raise RankUnavailable(f"rank {self.rank} cannot copy: {reason}")

    def __repr__(self) -> str:
        return f"Fabric(rank={self.rank}, node={self.node!r}, {self.state.value}, v{self.version})"
