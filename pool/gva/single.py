"""One-piece xcopy: straight to ``Platform.copy`` or to the engine, without arrays.

``copy_one`` validates both ends with integer arithmetic against the view (the same
checks as ``xcopy.plan``); when both ends are mapped here and ``mapped`` is the first
allowed transport it is one platform copy, when the transport has a ``copy_one`` of its
own (``remote``) that is called; anything else goes through the batch path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from kvfabric.errors import KVFabricError
from kvfabric.platform.buffer import Buffer
from kvfabric.platform.types import CopyBatch, Span
from kvfabric.pool.gva.address import GVA_FLOOR, LOCAL_KEY, MEDIUM_REGION, window_key
from kvfabric.pool.gva.handle import XferHandle, submit
from kvfabric.pool.gva.transports.base import Transport
from kvfabric.pool.gva.view import View
from kvfabric.pool.gva.xcopy import choose, plan

if TYPE_CHECKING:
    from kvfabric.platform.base import Platform
    from kvfabric.pool.gva.config import GvaConfig


def _scalar_end(
    view: View, cfg: GvaConfig, platform: Platform, end: Any, n: int, what: str, version: int | None
) -> tuple[int, Span | None, int]:
    """(group key, span here or None, window offset) of one end of a one-piece copy, validated."""
    a = cfg.alignment
    if isinstance(end, (Span, Buffer)):
        span = end if isinstance(end, Span) else Span(end, 0, end.nbytes)
        if n > span.nbytes:
            raise ValueError(f"{what}: {n} B do not fit in a local span of {span.nbytes} B")
        if a > 1 and (span.ptr | n) & (a - 1):
            raise ValueError(f"{what} {span.ptr:#x} or size {n} is not {a}-byte aligned")
        return LOCAL_KEY, Span(span.buffer, span.offset, n), 0
    if isinstance(end, bool) or not isinstance(end, (int, np.integer)):
        raise TypeError(
            f"{what} must be a GVA, a local address, a Buffer or a Span, got {type(end).__name__}"
        )
    g = int(end)
    if g < GVA_FLOOR:
        if g <= 0:
            raise ValueError(f"{what} {g:#x} is neither a local address nor a GVA")
        if a > 1 and (g | n) & (a - 1):
            raise ValueError(f"{what} {g:#x} or size {n} is not {a}-byte aligned")
        return LOCAL_KEY, platform.find(g, n), 0
    seg, off = view.table.locate(g, n, version)
    if a > 1 and (off | n) & (a - 1):
        raise ValueError(f"{what} {g:#x} (offset {off}) or size {n} is not {a}-byte aligned")
    key = window_key(MEDIUM_REGION[seg.medium], seg.rank)
    e = view.ends.get(key)
    if e is None or not e.ptr or e.buffer is None:
        return key, None, off
    return key, Span(e.buffer, off, n), off


def copy_one(
    view: View,
    cfg: GvaConfig,
    platform: Platform,
    transports: dict[str, Transport],
    dst: Any,
    src: Any,
    nbytes: int | None,
    version: int | None,
    sync: bool,
) -> XferHandle | None:
    """One piece: a direct platform copy when both ends are mapped here (``None`` back on
    the synchronous path), else the batch path with one item."""
    if nbytes is None:
        sizes = [e.nbytes for e in (src, dst) if isinstance(e, (Buffer, Span))]
        if not sizes:
            raise ValueError("xcopy between two addresses needs nbytes")
        nbytes = sizes[0]
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)):
        raise TypeError(f"nbytes must be an int, got {type(nbytes).__name__}")
    n = int(nbytes)
    if n <= 0:
        raise ValueError(f"nbytes must be > 0, got {n}")
    dkey, dspan, doff = _scalar_end(view, cfg, platform, dst, n, "dst", version)
    skey, sspan, soff = _scalar_end(view, cfg, platform, src, n, "src", version)
    t: Transport | None = None
    if dspan is not None and sspan is not None:  # both ends addressable here
        allowed = cfg.allowed(view.rank_of(skey), view.rank_of(dkey)) if cfg.pair_rules else cfg.transports
        if allowed[0] == "mapped":
            t = transports.get("mapped")
    if t is None:
        t = choose(view, cfg, transports, skey, dkey)
    if t.name == "mapped" and dspan is not None and sspan is not None:
        pins = [e.mapped for k in (skey, dkey) if k != LOCAL_KEY and (e := view.ends[k]).mapped is not None]
        for m in pins:
            m.pin()
        try:
            comp = t.copy_spans(dspan, sspan, sync)  # type: ignore[attr-defined]
        except BaseException:
            for m in pins:
                m.unpin()
            raise
        if sync:
            for m in pins:
                m.unpin()
            return None
        h = XferHandle(1)
        h._add(np.zeros(1, np.int64), comp, pins)
        return h
    one = getattr(t, "copy_one", None)
    if one is not None:  # a transport with its own one-piece path (no arrays)
        if sync:
            one(view, dkey, dspan, doff, skey, sspan, soff, n, True).wait()
            return None
        h = XferHandle(1)
        try:
            h._add(np.zeros(1, np.int64), one(view, dkey, dspan, doff, skey, sspan, soff, n, False), [])
        except KVFabricError as err:  # as in the batch path: a failed item, not an exception
            h._fail(np.zeros(1, np.int64), err)
        return h
    d = np.array([dspan.ptr if dkey == LOCAL_KEY and dspan is not None else _raw(dst)], np.uint64)
    s = np.array([sspan.ptr if skey == LOCAL_KEY and sspan is not None else _raw(src)], np.uint64)
    planned = plan(view, cfg, platform, transports, CopyBatch(d, s, np.array([n], np.uint64)), version)
    return submit(view, planned, sync)


def _raw(end: Any) -> int:
    return end.ptr if isinstance(end, (Buffer, Span)) else int(end)
