"""Planning an xcopy: validate every item, group by (source, destination), pick transports.

Each end of an item is a GVA (an int >= ``GVA_FLOOR``) or local memory (a ``Buffer``,
a ``Span``, or an int address inside a live buffer of this process's platform). The
direction follows from the two ends: local->global, global->local, global->global; host
or device from the media. :func:`plan` checks the *whole* batch before anything moves:
sizes > 0, alignment, each GVA inside a window of a current member (a range may not
cross a window's end), the table version the caller computed the addresses under, local
ranges inside live buffers, and a transport for every group. Any failure raises
(``ValueError``/``TypeError`` for bad input, ``RankUnavailable`` for a rank that is not
in the table, ``StaleSegmentTable``, ``TransferFailed`` when no transport can serve a
pair) and nothing is written.

:class:`XferHandle` is what an asynchronous xcopy returns: ``check()`` polls,
``wait(timeout)`` blocks, ``status`` is a per-item :class:`ItemStatus` array (a failed
group marks its items ``FAILED``; other groups are unaffected), ``errors`` lists why.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvfabric.errors import KVFabricError, RankUnavailable, StaleSegmentTable, TransferFailed
from kvfabric.platform.buffer import Buffer
from kvfabric.platform.types import CopyBatch, Span
from kvfabric.pool.gva.address import GVA_FLOOR, MEDIUM_REGION, REGION_MEDIUM, decode_many
from kvfabric.pool.gva.transports.base import Completion, GroupPlan, Transport
from kvfabric.pool.gva.view import LOCAL_KEY, RANK_BITS, MappedWindow, View

if TYPE_CHECKING:
    from kvfabric.platform.base import Platform
    from kvfabric.pool.gva.config import GvaConfig


class ItemStatus(enum.IntEnum):
    PENDING = 0
    OK = 1
    FAILED = 2


def as_batch(items: CopyBatch | Iterable[tuple[Any, Any, int]]) -> CopyBatch:
    """A :class:`CopyBatch` from one, or from ``(dst, src, nbytes)`` tuples whose ends are
    GVAs, local addresses, buffers or spans (a span shorter than ``nbytes`` is refused)."""
    if isinstance(items, CopyBatch):
        return items
    if not isinstance(items, (list, tuple)):
        items = list(items)
    for i, it in enumerate(items):
        if isinstance(it, tuple) and len(it) == 3:
            for end in it[:2]:
                if isinstance(end, (Buffer, Span)) and isinstance(it[2], int) and it[2] > end.nbytes:
                    raise ValueError(f"item {i}: {it[2]} B do not fit in a local span of {end.nbytes} B")
    return CopyBatch.from_items(items)


def _bad(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def _check_side(
    view: View, cfg: GvaConfig, what: str, raw: np.ndarray, n: np.ndarray, version: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """Validate one side; return (group keys, offsets)."""
    table = view.table
    region, rank, off = decode_many(table.space, raw)
    if (region < 0).any():
        i = _bad(region < 0)
        raise ValueError(f"item {i}: {what} {int(raw[i]):#x} is neither a local address nor a GVA")
    gva = region > 0
    keys = np.zeros(raw.size, np.int64)
    a = cfg.alignment
    if a > 1:
        mis = ((off & np.uint64(a - 1)) != 0) | ((n & np.uint64(a - 1)) != 0)
        if mis.any():
            i = _bad(mis)
            raise ValueError(
                f"item {i}: {what} {int(raw[i]):#x} (offset {int(off[i])}) or size {int(n[i])} "
                f"is not {a}-byte aligned"
            )
    if not gva.any():
        return keys, off
    if version is not None:
        table.check_version(version)
    for reg in (1, 2):
        sel = region == reg
        if not sel.any():
            continue
        sizes, since, _ptrs = view.cols[reg]
        r = rank[sel]
        o = off[sel].astype(np.int64)
        k = n[sel].astype(np.int64)
        idx = np.flatnonzero(sel)
        known = r < sizes.size
        sz = np.where(known, sizes[np.where(known, r, 0)], 0)
        if (sz == 0).any():
            j = _bad(sz == 0)
            i = int(idx[j])
            table.segment(REGION_MEDIUM[reg], int(r[j]))  # raises RankUnavailable naming it
            raise RankUnavailable(f"item {i}: {what} names rank {int(r[j])}, which has no window")
        if (o >= sz).any():
            j = _bad(o >= sz)
            raise ValueError(
                f"item {int(idx[j])}: {what} {int(raw[idx[j]]):#x} is offset {int(o[j])} of rank "
                f"{int(r[j])}'s {REGION_MEDIUM[reg].value} window of {int(sz[j])} B (outside the window)"
            )
        if (o + k > sz).any():
            j = _bad(o + k > sz)
            raise ValueError(
                f"item {int(idx[j])}: {what} range {int(raw[idx[j]]):#x}+{int(k[j])} crosses the end of rank "
                f"{int(r[j])}'s {REGION_MEDIUM[reg].value} window ({int(sz[j])} B, offset {int(o[j])})"
            )
        if version is not None:
            st = since[r] > version
            if st.any():
                j = _bad(st)
                raise StaleSegmentTable(
                    f"item {int(idx[j])}: {what} is from segment table v{version}, but rank {int(r[j])} "
                    f"rejoined at v{int(since[r[j]])}; its old addresses name memory that is gone"
                )
        keys[sel] = (reg << RANK_BITS) | r
    return keys, off


@dataclass(frozen=True)
class Planned:
    """A validated batch: its groups and the transport chosen for each."""

    n: int
    groups: tuple[GroupPlan, ...]
    transports: tuple[Transport, ...]


def choose(view: View, cfg: GvaConfig, transports: dict[str, Transport], skey: int, dkey: int) -> Transport:
    src_rank, dst_rank = view.rank_of(skey), view.rank_of(dkey)
    allowed = cfg.allowed(src_rank, dst_rank)
    for name in allowed:
        t = transports.get(name)
        if t is not None and t.can_serve(view, skey, dkey):
            return t
    why = []
    for name in allowed:
        if name not in transports:
            why.append(f"{name}: not enabled in this process")
        elif name == "mapped":
            why.append("mapped: a window is on another node or not mapped here")
        else:
            why.append(f"{name}: no engine route to the far rank (or both ends are far)")
    raise TransferFailed(
        f"no transport can copy rank {src_rank} -> rank {dst_rank} from rank {view.rank} "
        f"(allowed: {', '.join(allowed)}; {'; '.join(why)})"
    )


def plan(
    view: View,
    cfg: GvaConfig,
    platform: Platform,
    transports: dict[str, Transport],
    batch: CopyBatch,
    version: int | None,
) -> Planned:
    """Validate ``batch`` and split it into transport groups (see module docstring)."""
    n = batch.nbytes
    if n.size == 0:
        return Planned(0, (), ())
    if not n.all():
        raise ValueError(f"item {_bad(n == 0)}: nbytes must be > 0, got 0")
    if n.max() >= 1 << 62:
        raise ValueError(f"item {_bad(n >= 1 << 62)}: nbytes {int(n.max())} is not a size")
    dkeys, doff = _check_side(view, cfg, "dst", batch.dst, n, version)
    skeys, soff = _check_side(view, cfg, "src", batch.src, n, version)
    pair = (skeys << (RANK_BITS + 2)) | dkeys
    first = pair[0]
    if (pair == first).all():
        parts = [(int(skeys[0]), int(dkeys[0]), np.arange(n.size))]
    else:
        uniq, inv = np.unique(pair, return_inverse=True)
        parts = []
        for g in range(uniq.size):
            idx = np.flatnonzero(inv == g)
            parts.append((int(skeys[idx[0]]), int(dkeys[idx[0]]), idx))
    groups, chosen = [], []
    for sk, dk, idx in parts:
        t = choose(view, cfg, transports, sk, dk)
        whole = idx.size == n.size
        groups.append(
            GroupPlan(
                sk,
                dk,
                idx,
                batch.dst if whole else batch.dst[idx],
                batch.src if whole else batch.src[idx],
                doff if whole else doff[idx],
                soff if whole else soff[idx],
                n if whole else n[idx],
            )
        )
        chosen.append(t)
    if len(groups) > 1 or chosen[0].name != "mapped":  # one mapped group is checked by batch_copy
        local_d, local_s = dkeys == LOCAL_KEY, skeys == LOCAL_KEY
        if local_d.any():
            platform.media_of(batch.dst[local_d], n[local_d], "dst")
        if local_s.any():
            platform.media_of(batch.src[local_s], n[local_s], "src")
    return Planned(int(n.size), tuple(groups), tuple(chosen))


class XferHandle:
    """An xcopy in flight (see module docstring). Thread-safe; one consumer waits."""

    def __init__(self, n: int) -> None:
        self.status = np.zeros(n, np.int8)
        self.errors: list[tuple[np.ndarray, BaseException]] = []
        self._parts: list[tuple[np.ndarray, Completion, list[MappedWindow]]] = []
        self._lock = threading.Lock()

    def _add(self, index: np.ndarray, comp: Completion, pins: list[MappedWindow]) -> None:
        self._parts.append((index, comp, pins))

    def _fail(self, index: np.ndarray, err: BaseException) -> None:
        self.status[index] = ItemStatus.FAILED
        self.errors.append((index, err))

    def _finish(self, k: int, timeout: float | None) -> None:
        index, comp, pins = self._parts[k]
        try:
            comp.wait(timeout)
        except TimeoutError:
            raise
        except KVFabricError as e:
            self._fail(index, e)
        else:
            self.status[index] = ItemStatus.OK
        for m in pins:
            m.unpin()
        self._parts[k] = (index, comp, [])

    def check(self) -> bool:
        """True when every item has finished (successfully or not); never blocks."""
        with self._lock:
            for k, (index, comp, _pins) in enumerate(self._parts):
                if self.status[index[0]] == ItemStatus.PENDING and comp.done():
                    self._finish(k, 0)
            return not (self.status == ItemStatus.PENDING).any()

    def wait(self, timeout: float | None = None) -> np.ndarray:
        """Block until every item finished; the status array. ``TimeoutError`` on expiry."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            for k, (index, _comp, _pins) in enumerate(self._parts):
                if self.status[index[0]] == ItemStatus.PENDING:
                    left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                    self._finish(k, left)
        return self.status

    @property
    def ok(self) -> bool:
        return bool((self.status == ItemStatus.OK).all())

    def raise_for_status(self) -> None:
        """``TransferFailed`` naming the failed items, chained to the first failure."""
        if self.errors:
            failed = int((self.status == ItemStatus.FAILED).sum())
            index, err = self.errors[0]
            raise TransferFailed(
                f"{failed} of {self.status.size} xcopy item(s) failed (first: item {int(index[0])}: {err})"
            ) from err


def submit(view: View, planned: Planned, sync: bool) -> XferHandle:
    """Run every group of ``planned``; failures land in the handle, never half-raised."""
    h = XferHandle(planned.n)
    for g, t in zip(planned.groups, planned.transports):
        pins: list[MappedWindow] = []
        try:
            for key in (g.src_key, g.dst_key):
                e = view.ends.get(key) if key != LOCAL_KEY else None
                if e is not None and e.mapped is not None and t.name == "mapped":
                    e.mapped.pin()
                    pins.append(e.mapped)
            comp = t.submit(view, g, sync)
        except (KVFabricError, OSError) as err:
            for m in pins:
                m.unpin()
            h._fail(g.index, err)
            continue
        if sync:
            for m in pins:
                m.unpin()
            h.status[g.index] = ItemStatus.OK
        else:
            h._add(g.index, comp, pins)
    return h


def pack(ends: Sequence[Any]) -> np.ndarray:
    """uint64 addresses of GVAs, local addresses, buffers and spans."""
    out = np.empty(len(ends), np.uint64)
    for i, e in enumerate(ends):
        out[i] = e.ptr if isinstance(e, (Buffer, Span)) else int(e)
    return out


def _scalar_end(
    view: View, cfg: GvaConfig, platform: Platform, end: Any, n: int, what: str, version: int | None
) -> tuple[int, Span | None, int]:
    """(group key, span here or None, window offset) of one end of a one-piece copy, validated."""
    if isinstance(end, Span):
        if n > end.nbytes:
            raise ValueError(f"{what}: {n} B do not fit in a local span of {end.nbytes} B")
        return LOCAL_KEY, Span(end.buffer, end.offset, n), 0
    if isinstance(end, Buffer):
        if n > end.nbytes:
            raise ValueError(f"{what}: {n} B do not fit in a local buffer of {end.nbytes} B")
        return LOCAL_KEY, Span(end, 0, n), 0
    if isinstance(end, bool) or not isinstance(end, (int, np.integer)):
        raise TypeError(
            f"{what} must be a GVA, a local address, a Buffer or a Span, got {type(end).__name__}"
        )
    g = int(end)
    a = cfg.alignment
    if g < GVA_FLOOR:
        if g <= 0:
            raise ValueError(f"{what} {g:#x} is neither a local address nor a GVA")
        if a > 1 and (g | n) & (a - 1):
            raise ValueError(f"{what} {g:#x} or size {n} is not {a}-byte aligned")
        return LOCAL_KEY, platform.find(g, n), 0
    seg, off = view.table.locate(g, n, version)
    if a > 1 and (off | n) & (a - 1):
        raise ValueError(f"{what} {g:#x} (offset {off}) or size {n} is not {a}-byte aligned")
    key = (MEDIUM_REGION[seg.medium] << RANK_BITS) | seg.rank
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
        comp = one(view, dkey, dspan, doff, skey, sspan, soff, n, sync)
        if sync:
            comp.wait()
            return None
        h = XferHandle(1)
        h._add(np.zeros(1, np.int64), comp, [])
        return h
    d = np.array([dspan.ptr if dkey == LOCAL_KEY and dspan is not None else _raw(dst)], np.uint64)
    s = np.array([sspan.ptr if skey == LOCAL_KEY and sspan is not None else _raw(src)], np.uint64)
    planned = plan(view, cfg, platform, transports, CopyBatch(d, s, np.array([n], np.uint64)), version)
    return submit(view, planned, sync)


def _raw(end: Any) -> int:
    return end.ptr if isinstance(end, (Buffer, Span)) else int(end)
