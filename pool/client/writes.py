"""``Writer``: how a pool client stores objects.

A batch of puts is one ``alloc`` RPC (space for every key, placed in this client's own
window first when it has one), one ``batch_xcopy`` of every piece of every object into
its GVA (mapped on the node, remote across nodes), and one ``commit`` RPC that publishes
the objects whose pieces all arrived and abandons the others (their space is freed at
once). Layer-wise writing splits the same steps: ``batch_alloc``, ``write`` pieces as
layers finish, ``batch_commit``.

Write fence, writer's half (the service's half is ``fence.py``): every allocation records
when its request left; no copy starts past ``lease - margin`` of that (the put is
abandoned instead, LEASE_EXPIRED), and a long batch is copied in chunks of at most
``CHUNK_BYTES`` with the leases renewed between chunks once half of them has passed.

Replicas: an allocation may come back with further extents per key (``replicas``: the
client's or the call's, else the pool's); every piece is copied into each of them, and a
key is committed only when its pieces arrived in every extent (else it is abandoned
whole: a put is readable once all its replicas are written). Layer-wise ``write`` mirrors
each piece into the further extents of the object it falls in.

Checksums: each committed object carries the writer's xxh3-64 (``platform.checksum``) of
its bytes, taken over the window after the copy where the window is mapped here (so the
copy itself is covered), else over the caller's host memory, else none (device memory
on another node): readers check it before a read counts.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvfabric.errors import LeaseExpired
from kvfabric.platform import checksum
from kvfabric.platform.types import Medium
from kvfabric.pool import protocol as p
from kvfabric.pool.client.dataplane import require
from kvfabric.pool.client.session import Session
from kvfabric.pool.keys import U64_MAX, as_u64, check_count, check_sizes
from kvfabric.pool.status import Status


def u64(values: Any, name: str = "values", positive: bool = False) -> np.ndarray:
    """Caller addresses or sizes as a flat uint64 array; ``ValueError`` naming ``name`` and
    the first bad index for what numpy would wrap or truncate (see ``keys.as_u64``)."""
    return as_u64(values, name, positive)


CHUNK_BYTES = 256 << 20  # a long batch is copied in chunks of this much, leases checked between
RENEW_AT = 0.5  # renew the leases once this share of them has passed


def _ranges(ptrs: np.ndarray, sizes: np.ndarray) -> list[tuple[int, int]]:
    return list(zip(ptrs.tolist(), sizes.tolist()))


def lease_margin(lease_s: float) -> float:
    """How long before its lease runs out a writer stops starting copies."""
    return min(max(0.1 * lease_s, 0.05), 2.0)


class Writer:
    """The write side of one pool client, over its :class:`Session` (see module docstring).
    Keys arrive encoded (``list[bytes]``: the client encodes and checks them once a batch)."""

    def __init__(self, session: Session) -> None:
        self.c = session
        self._lock = threading.Lock()
        #: key -> (gva, size, gen, alloc sent at, the further extents' gvas)
        self.pending: dict[bytes, tuple[int, int, int, float, tuple[int, ...]]] = {}
        self.abandoned = 0  # puts given up because their lease was about to run out
        self.under_replicated = 0  # puts placed on fewer ranks than the replicas asked for

    def alloc(
        self,
        kb: list[bytes],
        sizes: Any,
        preferred_rank: int | None,
        medium: Medium | None,
        replicas: int | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """``PoolClient.batch_alloc`` of keys already encoded (``keys.encode_keys``);
        ``replicas``: extents per key (None: the client's default, else the pool's)."""
        sz = check_sizes(as_u64(sizes, "sizes", positive=True).tolist())
        if len(sz) != len(kb):
            raise ValueError(f"batch_alloc: {len(kb)} keys but {len(sz)} sizes")
        check_count(kb, "keys")
        c = self.c
        c.require_data()
        n_rep = p.check_replicas(replicas) if replicas is not None else c.options.replicas
        sent = time.monotonic()  # the lease started no earlier than this
        mname = None if medium is None else medium.value
        r = c.call(p.Alloc(c.client_id, kb, sz, c.rank, preferred_rank, mname, n_rep))
        extra = r.replicas or [[] for _ in kb]
        want = n_rep or c.replicas
        with self._lock:
            for k, s, g, gen, n, more in zip(kb, r.status, r.gvas, r.gens, sz, extra):
                if s == Status.OK:
                    self.pending[k] = (g, n, gen, sent, tuple(more))
                    if 1 + len(more) < want:
                        self.under_replicated += 1
        return np.array(r.status, np.int8), np.array(r.gvas, np.uint64)

    def extents(self, key: bytes) -> tuple[int, ...]:
        """The gvas of every extent of a pending key, the first one first (() when none)."""
        with self._lock:
            e = self.pending.get(key)
        return () if e is None else (e[0], *e[4])

    # ------------------------------------------------------------------ fence, writer's half
    def _leases_ok(self, kb: list[bytes]) -> np.ndarray:
        """Whether each allocated key may still be copied into: renews the leases past
        ``RENEW_AT``; False once a lease is within its margin of running out (or unknown).
        Plain Python: a batch is a handful of keys, and this runs before every copy."""
        c = self.c
        lease_s = c.write_lease_s
        cutoff = lease_s - lease_margin(lease_s)
        now = time.monotonic()
        with self._lock:
            sent = [e[3] if (e := self.pending.get(k)) is not None else None for k in kb]
        ok = [t is not None and now < t + cutoff for t in sent]
        stale = [i for i, (t, f) in enumerate(zip(sent, ok)) if f and now >= t + RENEW_AT * lease_s]
        if stale:
            renew = [kb[i] for i in stale]
            t = time.monotonic()
            st = c.call(p.Renew(c.client_id, renew)).status
            with self._lock:
                for i, k, s in zip(stale, renew, st):
                    if s == Status.OK and k in self.pending:
                        g, n, gen, _, more = self.pending[k]
                        self.pending[k] = (g, n, gen, t, more)
                    else:
                        ok[i] = False
        return np.array(ok, bool)

    def _may_write(self, gvas: np.ndarray) -> np.ndarray:
        """For layer-wise writes: whether each address lies in a pending object whose lease
        still allows a copy (``_leases_ok``, which renews the ones past ``RENEW_AT``)."""
        with self._lock:
            held = sorted((e[0], e[0] + e[1], k) for k, e in self.pending.items())
        if not held:
            return np.zeros(gvas.size, bool)
        lo = np.array([h[0] for h in held], np.uint64)
        hi = np.array([h[1] for h in held], np.uint64)
        i = np.maximum(np.searchsorted(lo, gvas, side="right") - 1, 0)
        inside = (gvas >= lo[i]) & (gvas < hi[i])
        used = np.unique(i[inside])
        fresh = np.zeros(len(held), bool)
        fresh[used] = self._leases_ok([held[j][2] for j in used.tolist()])
        return inside & fresh[i]

    def _seal(self, gva: int, size: int, ranges: list[tuple[int, int]] | None) -> int:
        """The object's checksum: over the window where it is mapped here, else over the
        caller's host pieces (``ranges``), else 0 (none)."""
        loc = self.c.dp.local(gva, size)
        if loc is not None and loc[1]:
            return checksum.digest_range(loc[0], size)
        return checksum.digest_ranges(ranges) if ranges is not None else checksum.NONE

    def _mirrors(self, g: np.ndarray, src: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, ...]:
        """The pieces again for the further extents of the pending objects they fall in."""
        with self._lock:
            held = [(e[0], e[0] + e[1], e[4]) for e in self.pending.values() if e[4]]
        if not held:
            return g, src, n
        gs, ss, ns = [g], [src], [n]
        for lo, hi, more in held:
            inside = (g >= lo) & (g < hi)
            if inside.any():
                for m in more:
                    gs.append(g[inside] - np.uint64(lo) + np.uint64(m))
                    ss.append(src[inside])
                    ns.append(n[inside])
        return np.concatenate(gs), np.concatenate(ss), np.concatenate(ns)

    def write(self, gvas: Any, ptrs: Any, sizes: Any) -> None:
        g, src, n = u64(gvas, "gvas"), u64(ptrs, "ptrs"), u64(sizes, "sizes", positive=True)
        if not (g.size == src.size == n.size):
            raise ValueError(f"write: {g.size} gvas, {src.size} ptrs, {n.size} sizes")
        self.c.dp.check_user(src, n)
        late = ~self._may_write(g)
        if late.any():
            self.abandoned += 1
            raise LeaseExpired(
                f"pool write: {int(late.sum())} of {g.size} piece(s) target space whose write lease "
                "has run out (or was never allocated); commit the keys with ok=False"
            )
        require(self.c.dp.write(*self._mirrors(g, src, n)), "pool write")

    def batch_commit(
        self,
        kb: list[bytes],
        ok: Sequence[bool] | None = None,
        ttl_s: float | None = None,
        sums: Sequence[int] | None = None,
    ) -> np.ndarray:
        """Publish (or abandon) allocated keys (encoded). ``sums``: their checksums when the
        caller took them; else each published object is sealed here over its mapped window."""
        flags = [True] * len(kb) if ok is None else [bool(x) for x in ok]
        c = self.c
        if sums is None:
            with self._lock:
                entries = [self.pending.get(k) for k in kb]
            sums = [
                self._seal(e[0], e[1], None) if f and e is not None else checksum.NONE
                for e, f in zip(entries, flags)
            ]
        sums = [int(x) for x in sums]
        st = c.call(p.Commit(c.client_id, kb, flags, ttl_s, sums)).status
        with self._lock:
            for k, s, f, h in zip(kb, st, flags, sums):
                entry = self.pending.pop(k, None)
                if entry is None or s != Status.OK or not f:
                    continue
                for g in (entry[0], *entry[4]):  # any extent in this client's window is its own
                    if c.in_own_window(g):
                        c.owned.add(k, (g, entry[1], entry[2], h))
        return np.array(st, np.int8)

    def batch_put_from_layers(
        self, kb: list[bytes], ptrs: Any, sizes: Any, replicas: int | None = None
    ) -> np.ndarray:
        """Store each (encoded) key from its row of pieces: one alloc, one copy (into every
        extent of every key), one commit."""
        P = u64(ptrs, "ptrs").reshape(np.shape(ptrs))
        if P.ndim == 1:
            P = P.reshape(len(kb), -1)
        S = u64(sizes, "sizes", positive=True).reshape(np.shape(sizes))
        S = np.broadcast_to(S, P.shape) if S.ndim == 1 else S
        if P.shape[0] != len(kb) or S.shape != P.shape:
            raise ValueError(f"ptrs {P.shape} / sizes {S.shape} do not match {len(kb)} keys")
        if S.size and int(S.max()) > U64_MAX // S.shape[1]:
            raise ValueError(f"sizes: the {S.shape[1]} pieces of an object add up past 2**64 - 1 B")
        host_user = self.c.dp.check_user(P.reshape(-1), S.reshape(-1))
        st, gvas = self.alloc(kb, S.sum(axis=1).tolist(), None, None, replicas)
        ok = st == Status.OK
        if not ok.any():
            return st
        rows = np.flatnonzero(ok)
        Pok, Sok = np.ascontiguousarray(P[rows]), np.ascontiguousarray(S[rows])
        offs = np.cumsum(Sok, axis=1) - Sok
        G = gvas[rows][:, None] + offs
        kb = [kb[i] for i in rows.tolist()]
        # one copy row per extent of each key (its first extent's row is G's)
        owner = [(r, g) for r, k in enumerate(kb) for g in self.extents(k)[1:]]
        obj = np.array([*range(len(kb)), *(r for r, _ in owner)], np.int64)
        Gx = (
            G
            if not owner
            else np.vstack([G, np.array([g for _, g in owner], np.uint64)[:, None] + offs[obj[len(kb) :]]])
        )
        try:
            arrived, gave_up = self._copy_rows([kb[i] for i in obj.tolist()], Gx, Pok[obj], Sok[obj])
        except Exception:
            self.batch_commit(kb, [False] * rows.size, sums=[0] * rows.size)
            raise
        whole = np.ones(len(kb), bool)
        late = np.zeros(len(kb), bool)
        np.logical_and.at(whole, obj, arrived)
        np.logical_or.at(late, obj, gave_up)
        whole &= ~late
        sums = [
            self._seal(int(G[r, 0]), int(Sok[r].sum()), _ranges(Pok[r], Sok[r]) if host_user else None)
            if whole[r]
            else checksum.NONE
            for r in range(rows.size)
        ]
        cst = self.batch_commit(kb, whole.tolist(), sums=sums)
        st[rows] = np.where(whole, cst, np.where(late, Status.LEASE_EXPIRED, Status.TRANSFER_FAILED))
        return st

    def _copy_rows(
        self, kb: list[bytes], G: np.ndarray, P: np.ndarray, S: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Copy each object's pieces (row r: ``S[r]`` bytes from ``P[r]`` to ``G[r]``) in
        chunks of about ``CHUNK_BYTES``, checking (and renewing) the leases before each
        chunk. ``(arrived whole, given up for its lease)`` per row."""
        n = len(kb)
        whole = np.zeros(n, bool)
        late = np.zeros(n, bool)
        totals = S.sum(axis=1)
        start = 0
        while start < n:
            stop = start + 1
            acc = int(totals[start])
            while stop < n and acc + int(totals[stop]) <= CHUNK_BYTES:
                acc += int(totals[stop])
                stop += 1
            go = self._leases_ok(kb[start:stop])
            late[start:stop] = ~go
            if not go.all():
                self.abandoned += int((~go).sum())
            sel = np.arange(start, stop)[go]
            if sel.size:
                arrived = self.c.dp.write(G[sel].reshape(-1), P[sel].reshape(-1), S[sel].reshape(-1))
                whole[sel] = arrived.reshape(sel.size, -1).all(axis=1)
            start = stop
        return whole, late

    def put_one(self, key: bytes, ptr: int, nbytes: int, replicas: int | None = None) -> Status:
        """The hot path of a single one-piece put: the same alloc / copy / commit steps
        without building arrays (the copy is a plain memmove when the space is mapped here)."""
        if nbytes <= 0:
            raise ValueError(f"piece sizes must be > 0, got {nbytes}")
        c = self.c
        host_user = c.dp.check_user_one(ptr, nbytes)
        kb = [key]
        st, gvas = self.alloc(kb, [nbytes], None, None, replicas)
        if st[0] != Status.OK:
            return Status(int(st[0]))
        gva = int(gvas[0])
        try:
            if not self._leases_ok(kb)[0]:
                self.abandoned += 1
                self.batch_commit(kb, [False], sums=[0])
                return Status.LEASE_EXPIRED
            arrived = all([c.dp.write_one(g, ptr, nbytes, host_user) for g in self.extents(key)])
        except Exception:
            self.batch_commit(kb, [False], sums=[0])
            raise
        h = self._seal(gva, nbytes, [(ptr, nbytes)] if host_user else None) if arrived else 0
        cst = int(self.batch_commit(kb, [arrived], sums=[h])[0])
        return Status(cst) if arrived else Status.TRANSFER_FAILED

    def batch_put(self, kb: list[bytes], values: Sequence[bytes], replicas: int | None = None) -> np.ndarray:
        if len(kb) != len(values):
            raise ValueError(f"batch_put: {len(kb)} keys but {len(values)} values")
        if any(len(v) == 0 for v in values):
            raise ValueError("batch_put: values must not be empty")
        staging = np.concatenate([np.frombuffer(v, np.uint8) for v in values])
        buf = self.c.platform.wrap(staging)
        try:
            sizes = np.fromiter((len(v) for v in values), np.uint64, len(values))
            offs = np.cumsum(sizes) - sizes
            return self.batch_put_from_layers(
                kb, (np.uint64(staging.ctypes.data) + offs)[:, None], sizes[:, None], replicas
            )
        finally:
            self.c.platform.free(buf)
