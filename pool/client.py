"""``PoolClient``: put / get / exists / remove, batched and zero-copy, against one pool.

A client talks to the meta service for metadata only (one RPC per batch for alloc, one
for commit; none for reads on the same node) and moves object bytes itself between its
buffers and the windows (``MappedDataPlane``). Reads on the node look keys up in the
shared directory table (``table.py``), copy, and re-check the slot afterwards, so an
object removed or evicted meanwhile is a miss or a retry, never wrong bytes.

Buffers: zero-copy calls take addresses of memory the client's platform knows
(``register_buffer`` for caller memory, or buffers from ``platform.alloc`` / ``wrap``);
the bytes API (``put`` / ``get``) stages through Python bytes.

Single calls raise typed errors (``KeyNotFound``, ``OutOfSpace``, ``LeaseExpired``,
``TransferFailed``, ``ServiceUnavailable``); batch calls return a per-key ``Status``
array and raise only when the service itself is unreachable. Thread-safe.

``local_reads=False`` makes a client on the node read like one on another node (RPC read
leases), which is also how that path is tested.

A client may contribute a window of its own (``window_bytes``): it becomes a rank of the
pool, objects may be placed in its memory (its own puts first), and it re-registers
those objects if the meta service restarts. ``metadata_only`` clients map nothing and
can only ask about keys.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvfabric.errors import KeyNotFound, LeaseExpired, OutOfSpace, TransferFailed
from kvfabric.platform.base import Platform
from kvfabric.platform.buffer import Buffer
from kvfabric.platform.types import Medium
from kvfabric.pool import protocol as p
from kvfabric.pool.dataplane import MappedDataPlane
from kvfabric.pool.keys import encode_key, encode_keys
from kvfabric.pool.reads import Reader
from kvfabric.pool.rpc import Transport
from kvfabric.pool.status import Status
from kvfabric.pool.table import TableRetired, TableView, attach
from kvfabric.pool.windows import Addressing

log = logging.getLogger("kvfabric.pool.client")


def _u64(values: Any) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(values, dtype=np.uint64).reshape(-1))


class PoolClient:
    """See module docstring. Build with :func:`kvfabric.pool.connect` or an embedded pool."""

    def __init__(
        self,
        transport: Transport,
        platform: Platform,
        addressing: Addressing,
        *,
        window_bytes: int = 0,
        window_medium: Medium = Medium.DRAM,
        metadata_only: bool = False,
        local_reads: bool = True,
        client_id: str | None = None,
    ) -> None:
        self.transport = transport
        self.platform = platform
        self.addr = addressing
        self.client_id = client_id or f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.metadata_only = metadata_only
        self.local_reads = local_reads
        self.dp = MappedDataPlane(platform, addressing)
        self.table: TableView | None = None
        self.rank: int | None = None
        self._window: Buffer | None = None
        self._window_medium = window_medium
        self._owned: dict[bytes, tuple[int, int, int]] = {}  # objects in our window
        self._pending: dict[bytes, tuple[int, int, int]] = {}  # allocated, not committed
        self._lock = threading.Lock()
        self._epoch = 0
        self._closed = False
        info = self._call(p.Info()).data
        self._sync(info)
        if window_bytes and not metadata_only:
            self._window = platform.alloc(window_bytes, window_medium, shareable=True)
            self._add_window(-1)
        self.reader = Reader(self)

    # ------------------------------------------------------------------ plumbing
    def _call(self, req: Any) -> p.Reply:
        reply = self.transport.call(req)
        if self._epoch and reply.epoch != self._epoch:
            self._on_restart(reply.epoch)
        self._epoch = reply.epoch
        return reply

    def _sync(self, info: dict[str, Any]) -> None:
        """Attach the directory table and map every window the service lists."""
        if self.metadata_only:
            return
        if self.local_reads and (self.table is None or self.table.seg.name != info["table"]):
            try:
                self.table = attach(info["table"], info["table_bytes"])
            except Exception as e:  # noqa: BLE001 - another node: no shared table, use RPC
                log.info("pool directory table not mapped (%s); reads use RPC leases", e)
                self.table = None
        for w in info["windows"]:
            if w["rank"] != self.rank and w["handle"]:
                self.dp.map(w["rank"], Medium(w["medium"]), w["handle"])

    def _read(self, fn: Any, *args: Any) -> Any:
        """Run a read; if the service restarted under it (table retired), catch up once."""
        try:
            return fn(*args)
        except TableRetired:
            self.refresh()
            return fn(*args)

    def refresh(self) -> None:
        """Re-read the service's window list (new ranks) and table."""
        self._sync(self._call(p.Info()).data)

    def _add_window(self, rank: int) -> None:
        w = self._window
        if w is None:
            raise ValueError("this client contributes no window")
        reply = self._call(
            p.AddWindow(
                self.client_id, rank, w.medium.value, w.nbytes, self.platform.export_handle(w), os.getpid()
            )
        )
        self.rank = int(reply.data["rank"])
        self.dp.add_local(self.rank, w.medium, w)

    def _on_restart(self, epoch: int) -> None:
        """The meta service restarted: re-add our window, re-register our objects."""
        log.warning("pool meta service restarted (epoch %x -> %x); re-registering", self._epoch, epoch)
        self._epoch = epoch
        if self._window is not None and self.rank is not None:
            self._add_window(self.rank)
            with self._lock:
                items = list(self._owned.items())
            if items:
                keys = [k for k, _ in items]
                gv, sz, gn = zip(*(v for _, v in items))
                self._call(p.Reregister(keys, list(gv), list(sz), list(gn)))
        self.table = None
        self.refresh()

    # ------------------------------------------------------------------ metadata
    def exists(self, key: str) -> bool:
        return bool(self.batch_exists([key])[0])

    def batch_exists(self, keys: Sequence[str]) -> np.ndarray:
        kb = encode_keys(keys)
        if self.table is not None:
            return self._read(self.reader.exists_local, kb)
        return np.array(self._call(p.Exists(kb)).flags, dtype=bool)

    def remove(self, key: str) -> bool:
        return self.batch_remove([key])[0] == Status.OK

    def batch_remove(self, keys: Sequence[str]) -> np.ndarray:
        kb = encode_keys(keys)
        st = np.array(self._call(p.Remove(kb)).status, np.int8)
        with self._lock:
            for k in kb:
                self._owned.pop(k, None)
        return st

    def remove_all(self) -> int:
        with self._lock:
            self._owned.clear()
        return int(self._call(p.RemoveAll()).data["removed"])

    def info(self) -> dict[str, Any]:
        return dict(self._call(p.Info()).data)

    # ------------------------------------------------------------------ buffers
    def register_buffer(self, ptr: int, nbytes: int) -> Buffer:
        """Make caller memory usable by the zero-copy calls (pinned on device platforms)."""
        return self.platform.register_host(ptr, nbytes)

    def unregister_buffer(self, buf: Buffer) -> None:
        self.platform.free(buf)

    # ------------------------------------------------------------------ layer-wise writes
    def batch_alloc(
        self,
        keys: Sequence[str],
        sizes: Sequence[int],
        preferred_rank: int | None = None,
        medium: Medium | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Space for each key: ``(status, gva)``. Write pieces at ``gva + offset`` with
        :meth:`write`, then :meth:`batch_commit`. Uncommitted space is reclaimed when the
        write lease ends."""
        kb = encode_keys(keys)
        sz = [int(s) for s in sizes]
        if len(sz) != len(kb):
            raise ValueError(f"batch_alloc: {len(kb)} keys but {len(sz)} sizes")
        if any(s <= 0 for s in sz):
            raise ValueError("batch_alloc: sizes must be > 0")
        self._require_data()
        r = self._call(
            p.Alloc(
                self.client_id, kb, sz, self.rank, preferred_rank, None if medium is None else medium.value
            )
        )
        with self._lock:
            for k, s, g, gen, n in zip(kb, r.status, r.gvas, r.gens, sz):
                if s == Status.OK:
                    self._pending[k] = (g, n, gen)
        return np.array(r.status, np.int8), np.array(r.gvas, np.uint64)

    def write(self, gvas: Any, ptrs: Any, sizes: Any) -> None:
        """Copy caller pieces ``ptrs[i]`` (``sizes[i]`` bytes) to ``gvas[i]``."""
        g, src, n = _u64(gvas), _u64(ptrs), _u64(sizes)
        if not (g.size == src.size == n.size):
            raise ValueError(f"write: {g.size} gvas, {src.size} ptrs, {n.size} sizes")
        host = self.dp.check_user(src, n)
        dst, whost = self.dp.resolve_many(g, n)
        self.dp.copy(dst, src, n, host and bool(whost.all()))

    def batch_commit(
        self, keys: Sequence[str], ok: Sequence[bool] | None = None, ttl_s: float | None = None
    ) -> np.ndarray:
        kb = encode_keys(keys)
        flags = [True] * len(kb) if ok is None else [bool(x) for x in ok]
        st = self._call(p.Commit(self.client_id, kb, flags, ttl_s)).status
        with self._lock:
            for k, s, f in zip(kb, st, flags):
                entry = self._pending.pop(k, None)
                if entry is not None and s == Status.OK and f and self._in_own_window(entry[0]):
                    self._owned[k] = entry
        return np.array(st, np.int8)

    def _in_own_window(self, gva: int) -> bool:
        if self.rank is None or self._window is None:
            return False
        lo = self.addr.encode(self._window.medium, self.rank, 0)
        return lo <= gva < lo + self._window.nbytes

    def _require_data(self) -> None:
        if self.metadata_only:
            raise ValueError("a metadata-only pool client cannot move object bytes")
        if self._closed:
            raise ValueError("pool client is closed")

    # ------------------------------------------------------------------ puts
    def batch_put_from_layers(self, keys: Sequence[str], ptrs: Any, sizes: Any) -> np.ndarray:
        """Store each key from ``m`` pieces: ``ptrs`` is ``(k, m)``, ``sizes`` ``(m,)`` or
        ``(k, m)``. One alloc RPC, one batched copy, one commit RPC. Per-key statuses."""
        kb = encode_keys(keys)
        P = np.asarray(ptrs, dtype=np.uint64)
        if P.ndim == 1:
            P = P.reshape(len(kb), -1)
        S = np.asarray(sizes, dtype=np.uint64)
        S = np.broadcast_to(S, P.shape) if S.ndim == 1 else S
        if P.shape[0] != len(kb) or S.shape != P.shape:
            raise ValueError(f"ptrs {P.shape} / sizes {S.shape} do not match {len(kb)} keys")
        if (S == 0).any():
            raise ValueError("piece sizes must be > 0")
        host = self.dp.check_user(P.reshape(-1), S.reshape(-1))
        totals = S.sum(axis=1)
        st, gvas = self.batch_alloc(keys, totals.tolist())
        ok = st == Status.OK
        if ok.any():
            offs = np.cumsum(S[ok], axis=1) - S[ok]
            g = (gvas[ok][:, None] + offs).reshape(-1)
            try:
                dst, whost = self.dp.resolve_many(g, S[ok].reshape(-1))
                self.dp.copy(
                    dst,
                    np.ascontiguousarray(P[ok]).reshape(-1),
                    np.ascontiguousarray(S[ok]).reshape(-1),
                    host and bool(whost.all()),
                )
            except Exception:
                self.batch_commit([k for k, good in zip(keys, ok) if good], [False] * int(ok.sum()))
                raise
            cst = self.batch_commit([k for k, good in zip(keys, ok) if good])
            st[ok] = np.where(cst == Status.OK, Status.OK, cst)
        return st

    def put_from_layers(self, key: str, ptrs: Any, sizes: Any) -> Status:
        st = Status(int(self.batch_put_from_layers([key], _u64(ptrs)[None, :], _u64(sizes))[0]))
        return _raise_put(key, st)

    def batch_put_from(self, keys: Sequence[str], ptrs: Any, sizes: Any) -> np.ndarray:
        return self.batch_put_from_layers(keys, _u64(ptrs)[:, None], _u64(sizes)[:, None])

    def put_from(self, key: str, ptr: int, nbytes: int) -> Status:
        return _raise_put(key, Status(int(self.batch_put_from([key], [ptr], [nbytes])[0])))

    def batch_put(self, keys: Sequence[str], values: Sequence[bytes]) -> np.ndarray:
        if len(keys) != len(values):
            raise ValueError(f"batch_put: {len(keys)} keys but {len(values)} values")
        arrays = [np.frombuffer(v, np.uint8) if len(v) else None for v in values]
        if any(a is None for a in arrays):
            raise ValueError("batch_put: values must not be empty")
        staging = np.concatenate(arrays)
        buf = self.platform.wrap(staging) if staging.flags.writeable else None
        try:
            sizes = np.fromiter((a.nbytes for a in arrays), np.uint64, len(arrays))  # type: ignore[union-attr]
            offs = np.cumsum(sizes) - sizes
            return self.batch_put_from(keys, np.uint64(staging.ctypes.data) + offs, sizes)
        finally:
            if buf is not None:
                self.platform.free(buf)

    def put(self, key: str, value: bytes) -> Status:
        encode_key(key)
        return _raise_put(key, Status(int(self.batch_put([key], [value])[0])))

    # ------------------------------------------------------------------ gets
    def get_into(self, key: str, ptr: int, nbytes: int) -> int:
        """Copy the object into ``[ptr, ptr + nbytes)``; its size. ``KeyNotFound`` if absent."""
        return self._read(self.reader.get_into, encode_key(key), int(ptr), int(nbytes))

    def get_into_layers(self, key: str, ptrs: Any, sizes: Any) -> int:
        return self._read(self.reader.get_into_layers, encode_key(key), _u64(ptrs), _u64(sizes))

    def batch_get_into(self, keys: Sequence[str], ptrs: Any, sizes: Any) -> np.ndarray:
        return self._read(
            self.reader.batch_get_into_layers, encode_keys(keys), _u64(ptrs)[:, None], _u64(sizes)[:, None]
        )

    def batch_get_into_layers(self, keys: Sequence[str], ptrs: Any, sizes: Any) -> np.ndarray:
        kb = encode_keys(keys)
        P = np.asarray(ptrs, dtype=np.uint64).reshape(len(kb), -1)
        S = np.asarray(sizes, dtype=np.uint64)
        S = np.broadcast_to(S, P.shape) if S.ndim == 1 else S
        return self._read(self.reader.batch_get_into_layers, kb, P, S)

    def get(self, key: str) -> bytes:
        return self._read(self.reader.get, encode_key(key))

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        return [self._read(self.reader.get_or_none, k) for k in encode_keys(keys)]

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.rank is not None and self._window is not None:
            try:
                self._call(p.DropRank(self.rank))
            except Exception as e:  # noqa: BLE001 - closing: the service may be gone
                log.debug("drop_rank on close failed: %s", e)
        self.dp.close()
        if self._window is not None and not self._window.freed:
            self.platform.free(self._window)
        if self.table is not None:
            self.table.close()
        self.transport.close()

    def __enter__(self) -> PoolClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _raise_put(key: str, st: Status) -> Status:
    if st in (Status.OK, Status.EXISTS):
        return st
    if st == Status.NO_SPACE:
        raise OutOfSpace(f"no space for pool key {key!r}")
    if st == Status.LEASE_EXPIRED:
        raise LeaseExpired(f"write lease of pool key {key!r} expired before commit")
    if st == Status.NOT_FOUND:
        raise KeyNotFound(key)
    raise TransferFailed(f"put of pool key {key!r} failed: {st.name}")
