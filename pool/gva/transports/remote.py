"""``remote``: an existing transfer engine moves bytes between this process and another rank.

One end of a group must be addressable here (plain local memory, this rank's window, or
a mapped window): the *near* side; the other end is the window of a rank that published
a route for the engine: the *far* side. Near -> far is an engine write, far -> near a
read. Copies between two far ranks are refused (no third-party transfers).

The engine comes from ``ENGINES`` (lazily imported; ``GvaConfig.remote_engine``):
Mooncake Transfer Engine on CPU and CUDA hosts. Near-side memory is registered with the
engine on first use: the whole platform buffer that holds it, cached by address range
and dropped when that buffer is freed.
"""

from __future__ import annotations

import bisect
import threading
from typing import Any

import numpy as np

from kvfabric.errors import PlatformError
from kvfabric.platform.buffer import Buffer
from kvfabric.platform.types import Medium, Span
from kvfabric.pool.gva.address import LOCAL_KEY, REGION_MEDIUM, key_rank, key_region
from kvfabric.pool.gva.transports.base import Completion, GroupPlan, Transport, TransportContext
from kvfabric.pool.gva.view import View
from kvfabric.registry import Registry

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


class RemoteTransport(Transport):
    """Engine-backed copies to and from other ranks (see module docstring)."""

    name = "remote"

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        cfg = ctx.config
        self.engine_name = cfg.remote_engine
        self.engine = load_engine(cfg.remote_engine, cfg.remote_host, cfg.extra)
        self._reg = _Registry()

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
        self._ensure_registered(near, group.nbytes)
        medium = REGION_MEDIUM[key_region(far_key)].value
        what = (
            f"remote {'write' if write else 'read'} of {len(group)} piece(s), {group.total_bytes} B "
            f"{'to' if write else 'from'} rank {view.rank_of(far_key)}'s {medium} window at {route}"
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
        if id(near.buffer) not in self._reg.ids or near.buffer.freed:
            self._purge_freed()
            self._register(near.buffer)
        what = (
            f"remote {'write' if write else 'read'} of {n} B {'to' if write else 'from'} rank "
            f"{view.rank_of(far_key)} at {far[0]}"
        )
        return self.engine.transfer(far[0], write, [near.ptr], [remote], [n], sync, what)

    def close(self) -> None:
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
