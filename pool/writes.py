"""``Writer``: how a pool client stores objects.

A batch of puts is one ``alloc`` RPC (space for every key, placed in this client's own
window first when it has one), one ``batch_xcopy`` of every piece of every object into
its GVA (mapped on the node, remote across nodes), and one ``commit`` RPC that publishes
the objects whose pieces all arrived and abandons the others (their space is freed at
once). Layer-wise writing splits the same steps: ``batch_alloc``, ``write`` pieces as
layers finish, ``batch_commit``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvfabric.platform.types import Medium
from kvfabric.pool import protocol as p
from kvfabric.pool.dataplane import require
from kvfabric.pool.keys import U64_MAX, as_u64, check_count, check_sizes, encode_keys
from kvfabric.pool.status import Status

if TYPE_CHECKING:
    from kvfabric.pool.client import PoolClient


def u64(values: Any, name: str = "values", positive: bool = False) -> np.ndarray:
    """Caller addresses or sizes as a flat uint64 array; ``ValueError`` naming ``name`` and
    the first bad index for what numpy would wrap or truncate (see ``keys.as_u64``)."""
    return as_u64(values, name, positive)


class Writer:
    """The write side of one :class:`PoolClient` (see module docstring)."""

    def __init__(self, client: PoolClient) -> None:
        self.c = client
        self._lock = threading.Lock()
        self.pending: dict[bytes, tuple[int, int, int]] = {}  # allocated, not committed
        self.owned: dict[bytes, tuple[int, int, int]] = {}  # committed, in our own window

    def batch_alloc(
        self,
        keys: Sequence[str],
        sizes: Sequence[int],
        preferred_rank: int | None = None,
        medium: Medium | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        kb = encode_keys(keys)
        sz = check_sizes(as_u64(sizes, "sizes", positive=True).tolist())
        if len(sz) != len(kb):
            raise ValueError(f"batch_alloc: {len(kb)} keys but {len(sz)} sizes")
        check_count(kb, "keys")
        c = self.c
        c._require_data()
        r = c._call(
            p.Alloc(c.client_id, kb, sz, c.rank, preferred_rank, None if medium is None else medium.value)
        )
        with self._lock:
            for k, s, g, gen, n in zip(kb, r.status, r.gvas, r.gens, sz):
                if s == Status.OK:
                    self.pending[k] = (g, n, gen)
        return np.array(r.status, np.int8), np.array(r.gvas, np.uint64)

    def write(self, gvas: Any, ptrs: Any, sizes: Any) -> None:
        g, src, n = u64(gvas, "gvas"), u64(ptrs, "ptrs"), u64(sizes, "sizes", positive=True)
        if not (g.size == src.size == n.size):
            raise ValueError(f"write: {g.size} gvas, {src.size} ptrs, {n.size} sizes")
        self.c.dp.check_user(src, n)
        require(self.c.dp.write(g, src, n), "pool write")

    def batch_commit(
        self, keys: Sequence[str], ok: Sequence[bool] | None = None, ttl_s: float | None = None
    ) -> np.ndarray:
        kb = encode_keys(keys)
        flags = [True] * len(kb) if ok is None else [bool(x) for x in ok]
        c = self.c
        st = c._call(p.Commit(c.client_id, kb, flags, ttl_s)).status
        with self._lock:
            for k, s, f in zip(kb, st, flags):
                entry = self.pending.pop(k, None)
                if entry is not None and s == Status.OK and f and c.in_own_window(entry[0]):
                    self.owned[k] = entry
        return np.array(st, np.int8)

    def batch_put_from_layers(self, keys: Sequence[str], ptrs: Any, sizes: Any) -> np.ndarray:
        kb = encode_keys(keys)
        P = u64(ptrs, "ptrs").reshape(np.shape(ptrs))
        if P.ndim == 1:
            P = P.reshape(len(kb), -1)
        S = u64(sizes, "sizes", positive=True).reshape(np.shape(sizes))
        S = np.broadcast_to(S, P.shape) if S.ndim == 1 else S
        if P.shape[0] != len(kb) or S.shape != P.shape:
            raise ValueError(f"ptrs {P.shape} / sizes {S.shape} do not match {len(kb)} keys")
        if S.size and int(S.max()) > U64_MAX // S.shape[1]:
            raise ValueError(f"sizes: the {S.shape[1]} pieces of an object add up past 2**64 - 1 B")
        self.c.dp.check_user(P.reshape(-1), S.reshape(-1))
        st, gvas = self.batch_alloc(keys, S.sum(axis=1).tolist())
        ok = st == Status.OK
        if not ok.any():
            return st
        rows = np.flatnonzero(ok)
        Sok = np.ascontiguousarray(S[rows])
        offs = np.cumsum(Sok, axis=1) - Sok
        g = (gvas[rows][:, None] + offs).reshape(-1)
        try:
            arrived = self.c.dp.write(g, np.ascontiguousarray(P[rows]).reshape(-1), Sok.reshape(-1))
        except Exception:
            self.batch_commit([keys[i] for i in rows], [False] * rows.size)
            raise
        whole = arrived.reshape(rows.size, -1).all(axis=1)
        cst = self.batch_commit([keys[i] for i in rows], whole.tolist())
        st[rows] = np.where(whole, cst, Status.TRANSFER_FAILED)
        return st

    def put_one(self, key: str, ptr: int, nbytes: int) -> Status:
        """The hot path of a single one-piece put: the same alloc / copy / commit steps
        without building arrays (the copy is a plain memmove when the space is mapped here)."""
        if nbytes <= 0:
            raise ValueError(f"piece sizes must be > 0, got {nbytes}")
        c = self.c
        host_user = c.dp.check_user_one(ptr, nbytes)
        st, gvas = self.batch_alloc([key], [nbytes])
        if st[0] != Status.OK:
            return Status(int(st[0]))
        try:
            arrived = c.dp.write_one(int(gvas[0]), ptr, nbytes, host_user)
        except Exception:
            self.batch_commit([key], [False])
            raise
        cst = int(self.batch_commit([key], [arrived])[0])
        return Status(cst) if arrived else Status.TRANSFER_FAILED

    def batch_put(self, keys: Sequence[str], values: Sequence[bytes]) -> np.ndarray:
        if len(keys) != len(values):
            raise ValueError(f"batch_put: {len(keys)} keys but {len(values)} values")
        if any(len(v) == 0 for v in values):
            raise ValueError("batch_put: values must not be empty")
        staging = np.concatenate([np.frombuffer(v, np.uint8) for v in values])
        buf = self.c.platform.wrap(staging)
        try:
            sizes = np.fromiter((len(v) for v in values), np.uint64, len(values))
            offs = np.cumsum(sizes) - sizes
            return self.batch_put_from_layers(
                keys, (np.uint64(staging.ctypes.data) + offs)[:, None], sizes[:, None]
            )
        finally:
            self.c.platform.free(buf)

    def owned_items(self) -> list[tuple[bytes, tuple[int, int, int]]]:
        with self._lock:
            return list(self.owned.items())

    def forget(self, keys: list[bytes] | None = None) -> None:
        with self._lock:
            if keys is None:
                self.owned.clear()
            for k in keys or []:
                self.owned.pop(k, None)
