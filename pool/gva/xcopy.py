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
pair) and nothing is written. ``handle.submit`` then runs the groups; ``single.py`` is
the one-piece path.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvfabric.errors import RankUnavailable, StaleSegmentTable, TransferFailed
from kvfabric.platform.buffer import Buffer
from kvfabric.platform.types import CopyBatch, Span
from kvfabric.pool.gva.address import (
    GVA_FLOOR,
    LOCAL_KEY,
    REGION_MEDIUM,
    decode_many,
    pack,
    pair_keys,
    region_of,
    unpack,
    window_key,
    window_keys,
)
from kvfabric.pool.gva.transports.base import GroupPlan, Transport
from kvfabric.pool.gva.view import View

if TYPE_CHECKING:
    from kvfabric.platform.base import Platform
    from kvfabric.pool.gva.config import GvaConfig


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


def _uniform_side(
    view: View, cfg: GvaConfig, raw: np.ndarray, n: np.ndarray, version: int | None
) -> tuple[int, np.ndarray] | None:
    """``(key, offsets)`` when every item of a side is local memory or lies in one window,
    validated with a handful of array operations; None sends the side to the general path
    (which also produces the detailed error for anything wrong)."""
    lo, hi = int(raw.min()), int(raw.max())
    a = cfg.alignment
    if hi < GVA_FLOOR:
        if lo <= 0 or (a > 1 and ((raw | n) & np.uint64(a - 1)).any()):
            return None
        return LOCAL_KEY, raw
    region = region_of(lo)
    if lo < GVA_FLOOR or region != region_of(hi) or region not in REGION_MEDIUM:
        return None
    stride = view.table.space.stride(REGION_MEDIUM[region])
    if not stride:
        return None
    rank = unpack(lo, stride)[1]
    sizes = view.cols[region][0]
    if rank != unpack(hi, stride)[1] or rank >= sizes.size or not sizes[rank]:
        return None
    off = raw - np.uint64(pack(region, rank, 0, stride))
    if int((off + n).max()) > int(sizes[rank]) or (a > 1 and ((off | n) & np.uint64(a - 1)).any()):
        return None
    if version is not None:
        view.table.check_version(version, view.table.segment(REGION_MEDIUM[region], rank))
    return window_key(region, rank), off


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
        keys[sel] = window_keys(reg, r)
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
    if int(n.min()) == 0:
        raise ValueError(f"item {_bad(n == 0)}: nbytes must be > 0, got 0")
    if int(n.max()) >= 1 << 62:
        raise ValueError(f"item {_bad(n >= 1 << 62)}: nbytes {int(n.max())} is not a size")
    ud = _uniform_side(view, cfg, batch.dst, n, version)
    us = _uniform_side(view, cfg, batch.src, n, version) if ud is not None else None
    if ud is not None and us is not None:  # the common case: one group, no per-item keys
        (dk, doff), (sk, soff) = ud, us
        dkeys = skeys = None
        parts = [(sk, dk, np.arange(n.size))]
    else:
        dkeys, doff = _check_side(view, cfg, "dst", batch.dst, n, version)
        skeys, soff = _check_side(view, cfg, "src", batch.src, n, version)
        pair = pair_keys(skeys, dkeys)
        if (pair == pair[0]).all():
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
        for keys, ends, what in ((dkeys, batch.dst, "dst"), (skeys, batch.src, "src")):
            if keys is None:  # uniform side: all local or all in one window
                if (groups[0].dst_key if what == "dst" else groups[0].src_key) == LOCAL_KEY:
                    platform.media_of(ends, n, what)
            elif (local := keys == LOCAL_KEY).any():
                platform.media_of(ends[local], n[local], what)
    return Planned(int(n.size), tuple(groups), tuple(chosen))
