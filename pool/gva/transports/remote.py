"""``remote``: an existing transfer engine moves bytes between this process and another rank.

One end of a group must be addressable here (plain local memory, this rank's window, or
a mapped window): the *near* side; the other end is the window of a rank that published
a route for the engine: the *far* side. Near -> far is an engine write, far -> near a
read. Copies between two far ranks are refused (no third-party transfers).

The engine comes from ``ENGINES`` (lazily imported; ``GvaConfig.remote_engine``):
Mooncake Transfer Engine on CPU and CUDA hosts. Near-side memory is registered with the
engine on first use: the whole platform buffer that holds it, cached by address range
and dropped when that buffer is freed.

Bounded reads (``GvaConfig.remote_read_timeout`` > 0): a synchronous read is submitted
asynchronously into staging buffers of this transport (``staging.py``) and waited until
the deadline; on completion the bytes are copied to the caller, at the deadline it fails
with ``TransferFailed`` and the caller's memory is left as it was. The transfer given up
keeps its staging buffers until the engine reports it final (polled on later copies and
view changes). A peer that let a read time out, or failed a synchronous copy (refused,
reset: a dead peer's engine is retried with a growing backoff, so its failures come ever
later), is *suspect*: every copy to or from it fails at once, without reaching the
engine, until a read given up completes, the rank leaves the segment table, or
``remote_suspect_time`` has passed (then the next copy tries again, bounded). Writes and
asynchronous copies wait as the engine does (its own progress timeout): a write given up
could still land in remote space the pool has handed to another object by then.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvfabric.errors import PlatformError, TransferFailed
from kvfabric.platform.buffer import Buffer
from kvfabric.platform.types import CopyBatch, Medium, Span
from kvfabric.pool.gva.address import LOCAL_KEY, REGION_MEDIUM, key_rank, key_region
from kvfabric.pool.gva.transports.base import DONE, Completion, GroupPlan, Transport, TransportContext
from kvfabric.pool.gva.transports.staging import StagingPool
from kvfabric.pool.gva.view import View
from kvfabric.registry import Registry

log = logging.getLogger("kvfabric.gva")

STAGING_ALIGN = 64  # bytes between pieces of one staging buffer (at least GvaConfig.alignment)

ENGINES: Registry[Any] = Registry(
    "remote engine", {"mooncake": "kvfabric.pool.gva.transports.mooncake:MooncakeEngine"}
)


def load_engine(name: str, host: str, extra: Any) -> Any:
    engine_cls = ENGINES.load(name)
    return engine_cls(host, extra.get(f"{name}_protocol", "tcp"), extra.get(f"{name}_device", ""))


class _Registry:
    """Address ranges registered with the engine, looked up vectorised."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.starts: list[int] = []
        self.bufs: list[Buffer] = []
        self.ids: frozenset[int] = frozenset()
        self.snap: tuple[np.ndarray, np.ndarray, tuple[Buffer, ...]] = (
            np.zeros(0, np.uint64),
            np.zeros(0, np.uint64),
            (),
        )

    def rebuild(self) -> None:
        self.ids = frozenset(id(b) for b in self.bufs)
        self.snap = (
            np.array(self.starts, np.uint64),
            np.array([b.ptr + b.nbytes for b in self.bufs], np.uint64),
            tuple(self.bufs),
        )

    def misses(self, ptrs: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """Indices of ranges not inside a live registered buffer."""
        s, e, bufs = self.snap
        if s.size == 0:
            return np.arange(ptrs.size)
        i = np.maximum(np.searchsorted(s, ptrs, side="right").astype(np.int64) - 1, 0)
        ok = (ptrs >= s[i]) & ((ptrs + sizes) <= e[i])
        hit = np.unique(i[ok]).tolist()
        freed = [k for k in hit if bufs[k].freed]
        if freed:
            ok &= ~np.isin(i, freed)
        return np.flatnonzero(~ok)


@dataclass(frozen=True)
class Suspect:
    """A peer that let a read time out: ``since`` (monotonic seconds), ``rank``, ``what``."""

    since: float
    rank: int
    what: str


@dataclass(frozen=True)
class GivenUp:
    """A read given up at its deadline: still owns its staging buffers until final."""

    completion: Completion
    staging: tuple[Buffer, ...]
    route: str


class RemoteTransport(Transport):
    """Engine-backed copies to and from other ranks (see module docstring)."""

    name = "remote"

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        cfg = ctx.config
        self.engine_name = cfg.remote_engine
        self.engine = load_engine(cfg.remote_engine, cfg.remote_host, cfg.extra)
        self._reg = _Registry()
        self._staging = StagingPool(ctx.platform, self._register, self._forget)
        self._suspects: dict[str, Suspect] = {}  # by route
        self._given_up: list[GivenUp] = []
        self._state_lock = threading.Lock()  # guards _suspects and _given_up

    def routes(self) -> dict[str, str]:
        return {self.engine_name: self.engine.route}

    def _location(self, medium: Medium) -> str:
        if medium is Medium.HBM and self.ctx.platform.name != "sim":
            return f"{self.ctx.platform.name}:{self.ctx.platform.device}"
        return "cpu:0"

    def _register(self, buf: Buffer) -> None:
        reg = self._reg
        with reg.lock:
            i = bisect.bisect_left(reg.starts, buf.ptr)
            if i < len(reg.starts) and reg.bufs[i] is buf:
                return
            self.engine.register(buf.ptr, buf.nbytes, self._location(buf.medium))
            reg.starts.insert(i, buf.ptr)
            reg.bufs.insert(i, buf)
            reg.rebuild()

    def _forget(self, buf: Buffer) -> None:
        """Unregister ``buf`` (a staging buffer about to be freed) from the engine."""
        reg = self._reg
        with reg.lock:
            i = bisect.bisect_left(reg.starts, buf.ptr)
            if i < len(reg.starts) and reg.bufs[i] is buf:
                self.engine.unregister(buf.ptr)
                del reg.starts[i], reg.bufs[i]
                reg.rebuild()

    def register_window(self, buffer: object) -> None:
        if not isinstance(buffer, Buffer):
            raise TypeError(f"register_window needs a Buffer, got {type(buffer).__name__}")
        self._register(buffer)

    def _purge_freed(self) -> None:
        reg = self._reg
        with reg.lock:
            dead = [k for k, b in enumerate(reg.bufs) if b.freed]
            for k in reversed(dead):
                self.engine.unregister(reg.starts[k])
                del reg.starts[k], reg.bufs[k]
            if dead:
                reg.rebuild()

    def _ensure_registered(self, ptrs: np.ndarray, sizes: np.ndarray) -> None:
        miss = self._reg.misses(ptrs, sizes)
        if miss.size:
            self._purge_freed()
        for k in miss.tolist():
            span = self.ctx.platform.find(int(ptrs[k]), int(sizes[k]))
            self._register(span.buffer)

    def _far(self, view: View, key: int) -> tuple[str, int] | None:
        """``(route, owner's window address)`` of a far key, or None if not reachable."""
        if key == LOCAL_KEY or key_rank(key) == view.rank:
            return None
        e = view.endpoint(key)
        if e is None:
            return None
        route = e.segment.member.routes.get(self.engine_name)
        if not route or not e.segment.window.addr:
            return None
        return route, e.segment.window.addr

    # ------------------------------------------------------------------ suspects
    def update(self, view: View) -> None:
        """Forget suspects whose rank left (its route is no member's any more)."""
        self.poll_given_up()
        if not self._suspects:
            return
        live = {m.routes.get(self.engine_name) for m in view.table.members}
        with self._state_lock:
            for route in [r for r in self._suspects if r not in live]:
                del self._suspects[route]

    def suspect(self, route: str) -> Suspect | None:
        """The suspicion in force against the peer at ``route`` (None: copies go to it)."""
        if not self._suspects:
            return None
        self.poll_given_up()
        with self._state_lock:
            s = self._suspects.get(route)
            if s is not None and time.monotonic() - s.since >= self.ctx.config.remote_suspect_time:
                del self._suspects[route]
                return None
            return s

    def _mark(self, route: str, rank: int, why: str) -> None:
        """Make the peer at ``route`` suspect from now on (``why``: what it did)."""
        with self._state_lock:
            self._suspects[route] = Suspect(time.monotonic(), rank, why)

    def _sync_direct(
        self,
        route: str,
        rank: int,
        write: bool,
        near: list[int],
        remote: list[int],
        sizes: list[int],
        what: str,
    ) -> Completion:
        """A synchronous engine copy straight between the caller's memory and the peer;
        a failure makes the peer suspect (it did not deliver: refused, reset, retrying)."""
        try:
            return self.engine.transfer(route, write, near, remote, sizes, True, what)
        except TransferFailed as e:
            self._mark(route, rank, f"a synchronous copy failed ({e})")
            raise

    def _refuse_suspect(self, route: str, what: str) -> None:
        s = self.suspect(route)
        if s is not None:
            ago = time.monotonic() - s.since
            raise TransferFailed(
                f"{what}: refused without trying, rank {s.rank} at {route} is suspect ({s.what} "
                f"{ago:.1f} s ago); copies to it fail at once until that read completes, the rank "
                f"leaves the pool or {self.ctx.config.remote_suspect_time:g} s have passed"
            )

    def poll_given_up(self) -> int:
        """Hand back the staging buffers of given-up reads the engine has finished; a read
        that completed after all clears its peer's suspicion (it answers again). Runs on
        every copy while suspects exist and on every view change; returns how many reads
        given up the engine has still not finished."""
        if not self._given_up:
            return 0
        with self._state_lock:
            pending = []
            for g in self._given_up:
                if not g.completion.check():
                    pending.append(g)
                    continue
                try:
                    g.completion.wait(0)
                except TransferFailed:
                    pass
                else:
                    self._suspects.pop(g.route, None)
                for buf in g.staging:
                    self._staging.give(buf)
            self._given_up = pending
            return len(pending)

    # ------------------------------------------------------------------ bounded reads
    def _bounded_read(
        self, route: str, rank: int, near: np.ndarray, remote: np.ndarray, sizes: np.ndarray, what: str
    ) -> Completion:
        """Read ``remote`` pieces into staging, then copy them to ``near`` (see module
        docstring); ``TransferFailed`` at the deadline with ``near`` untouched."""
        timeout = self.ctx.config.remote_read_timeout
        stage, staged = self._stage(near, sizes)
        try:
            comp = self.engine.transfer(
                route, False, staged.tolist(), remote.tolist(), sizes.tolist(), False, what
            )
            comp.wait(timeout)
        except TimeoutError:
            with self._state_lock:
                self._given_up.append(GivenUp(comp, stage, route))
            self._mark(route, rank, f"a read did not complete within {timeout:g} s")
            log.warning("%s did not complete within %g s: rank %d is suspect", what, timeout, rank)
            raise TransferFailed(
                f"{what} did not complete within {timeout:g} s (GvaConfig.remote_read_timeout); "
                f"nothing was copied to the destination, and rank {rank} is suspect for "
                f"{self.ctx.config.remote_suspect_time:g} s"
            ) from None
        except BaseException as e:
            for buf in stage:  # refused, or the engine reported the read final: nothing lands later
                self._staging.give(buf)
            if isinstance(e, TransferFailed):  # a peer that refuses or resets: as bad as silent
                self._mark(route, rank, f"a read failed ({e})")
            raise
        try:
            self.ctx.platform.batch_copy(CopyBatch(near, staged, sizes))
        finally:
            for buf in stage:
                self._staging.give(buf)
        return DONE

    def _stage(self, near: np.ndarray, sizes: np.ndarray) -> tuple[tuple[Buffer, ...], np.ndarray]:
        """Staging buffers for pieces landing at ``near`` (one per medium, so a device
        destination gets device staging) and each piece's staging address."""
        align = max(STAGING_ALIGN, self.ctx.config.alignment)
        padded = (sizes + np.uint64(align - 1)) // np.uint64(align) * np.uint64(align)
        media = self.ctx.platform.media_of(near, sizes, "remote read destination")
        staged = np.zeros(near.size, np.uint64)
        bufs: list[Buffer] = []
        try:
            for code in np.unique(media).tolist():
                sel = np.flatnonzero(media == code)
                offs = np.cumsum(padded[sel]) - padded[sel]
                first = self.ctx.platform.find(int(near[sel[0]]), int(sizes[sel[0]]))
                buf = self._staging.take(first.buffer.medium, int(padded[sel].sum()))
                bufs.append(buf)
                staged[sel] = np.uint64(buf.ptr) + offs
        except BaseException:
            for buf in bufs:
                self._staging.give(buf)
            raise
        return tuple(bufs), staged

    def can_serve(self, view: View, src_key: int, dst_key: int) -> bool:
        if view.addressable(src_key) and self._far(view, dst_key) is not None:
            return True
        return view.addressable(dst_key) and self._far(view, src_key) is not None

    def submit(self, view: View, group: GroupPlan, sync: bool) -> Completion:
        write = view.addressable(group.src_key) and self._far(view, group.dst_key) is not None
        near_key, far_key = (group.src_key, group.dst_key) if write else (group.dst_key, group.src_key)
        far = self._far(view, far_key)
        if far is None or not view.addressable(near_key):
            raise PlatformError("remote transport was handed a group it cannot serve")
        route, far_base = far
        if write:
            near = view.local_ptrs(near_key, group.src, group.src_off)
            remote = group.dst_off + np.uint64(far_base)
        else:
            near = view.local_ptrs(near_key, group.dst, group.dst_off)
            remote = group.src_off + np.uint64(far_base)
        medium = REGION_MEDIUM[key_region(far_key)].value
        what = (
            f"remote {'write' if write else 'read'} of {len(group)} piece(s), {group.total_bytes} B "
            f"{'to' if write else 'from'} rank {view.rank_of(far_key)}'s {medium} window at {route}"
        )
        self._refuse_suspect(route, what)
        if sync and not write and self.ctx.config.remote_read_timeout > 0:
            return self._bounded_read(route, view.rank_of(far_key), near, remote, group.nbytes, what)
        self._ensure_registered(near, group.nbytes)
        if sync:
            return self._sync_direct(
                route,
                view.rank_of(far_key),
                write,
                near.tolist(),
                remote.tolist(),
                group.nbytes.tolist(),
                what,
            )
        return self.engine.transfer(
            route, write, near.tolist(), remote.tolist(), group.nbytes.tolist(), sync, what
        )

    def copy_one(
        self,
        view: View,
        dst_key: int,
        dst: Span | None,
        dst_off: int,
        src_key: int,
        src: Span | None,
        src_off: int,
        n: int,
        sync: bool,
    ) -> Completion:
        """One piece without arrays: ``dst``/``src`` are the spans of the near side."""
        far = self._far(view, dst_key) if src is not None else None
        if far is not None:
            write, near, far_key, remote = True, src, dst_key, far[1] + dst_off
        else:
            far = self._far(view, src_key)
            if far is None or dst is None:
                raise PlatformError("remote transport was handed a copy it cannot serve")
            write, near, far_key, remote = False, dst, src_key, far[1] + src_off
        assert near is not None
        what = (
            f"remote {'write' if write else 'read'} of {n} B {'to' if write else 'from'} rank "
            f"{view.rank_of(far_key)} at {far[0]}"
        )
        self._refuse_suspect(far[0], what)
        if sync and not write and self.ctx.config.remote_read_timeout > 0:
            return self._bounded_read(
                far[0],
                view.rank_of(far_key),
                np.array([near.ptr], np.uint64),
                np.array([remote], np.uint64),
                np.array([n], np.uint64),
                what,
            )
        if id(near.buffer) not in self._reg.ids or near.buffer.freed:
            self._purge_freed()
            self._register(near.buffer)
        if sync:
            return self._sync_direct(far[0], view.rank_of(far_key), write, [near.ptr], [remote], [n], what)
        return self.engine.transfer(far[0], write, [near.ptr], [remote], [n], sync, what)

    def close(self) -> None:
        self.poll_given_up()
        out = self._staging.close()
        if out:  # the engine may still write into them: left mapped until the process ends
            log.warning("remote transport closed with %d staging buffer(s) under reads given up", out)
        with self._reg.lock:
            for b in self._reg.bufs:
                if not b.freed:
                    try:
                        self.engine.unregister(b.ptr)
                    except Exception:  # noqa: BLE001 - best effort at shutdown
                        pass
            self._reg.starts.clear()
            self._reg.bufs.clear()
        self.engine.close()
