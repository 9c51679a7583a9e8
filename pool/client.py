"""``PoolClient``: put / get / exists / remove, batched and zero-copy, against one pool.

A client talks to the meta service for metadata only (one RPC per batch for alloc, one
for commit; none for reads or ``exists`` on the pool's node) and moves object bytes
itself, as a rank of the pool's GVA fabric (``FabricDataPlane``): windows on this node
are mapped here and copied with plain memory copies; windows elsewhere are reached
through the fabric's remote transport. Reads on the node look keys up in the shared
directory table, copy, and re-check the slot afterwards, so an object removed or evicted
meanwhile is a miss or a retry, never wrong bytes (``reads.py``); writes are in
``writes.py``.

Buffers: zero-copy calls take addresses of memory the client's platform knows
(``register_buffer`` for caller memory, or buffers from ``platform.alloc`` / ``wrap``);
the bytes API (``put`` / ``get``) stages through Python bytes.

Single calls raise typed errors (``KeyNotFound``, ``OutOfSpace``, ``LeaseExpired``,
``TransferFailed``, ``ServiceUnavailable``); batch calls return a per-key ``Status``
array and raise only when the service itself is unreachable. Thread-safe.

``window_bytes``: the client contributes a window of its own as a rank; objects may be
placed in its memory (its own puts first), and it re-registers those objects if the meta
service restarts. ``metadata_only``: no fabric, no data path; only ``exists`` and the
other metadata calls. ``local_reads=False``: read like a client on another node (RPC read
leases), which is also how that path is tested.

Integrity: every object carries its writer's checksum; with ``verify`` on (the pool's
setting unless the client says otherwise) a read counts only once the bytes it copied
match it. A mismatch is a miss (``CorruptObject``, a ``KeyNotFound``; ``Status.CORRUPT``
in batches), counted in ``corrupt`` and logged once; the object is removed so that the
next put rewrites it. Writes stop before their lease runs out (``writes.py``).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvfabric.errors import KeyNotFound, LeaseExpired, OutOfSpace, TransferFailed
from kvfabric.platform.base import Platform
from kvfabric.platform.buffer import Buffer
from kvfabric.platform.checksum import Verify
from kvfabric.platform.procmaps import check_mapped
from kvfabric.platform.types import Medium
from kvfabric.pool import protocol as p
from kvfabric.pool.dataplane import FabricDataPlane
from kvfabric.pool.gva.config import GvaConfig
from kvfabric.pool.gva.fabric import Fabric
from kvfabric.pool.keys import check_int, encode_key, encode_keys
from kvfabric.pool.reads import Reader
from kvfabric.pool.rpc import Transport
from kvfabric.pool.status import Status
from kvfabric.pool.table import TableRetired, TableView, attach
from kvfabric.pool.windows import FixedStride
from kvfabric.pool.writes import Writer, u64

log = logging.getLogger("kvfabric.pool.client")
JOIN_VISIBLE_S = 5.0


def gva_config(info: dict[str, Any]) -> GvaConfig:
    """The fabric configuration every rank of a pool shares (from the service's Info)."""
    return GvaConfig(
        namespace=info["namespace"],
        dram_stride=info["stride"],
        hbm_stride=info["stride"],
        transports=tuple(t.strip() for t in info["transports"].split(",") if t.strip()),
        heartbeat_ttl=info.get("session_ttl_s", 10.0),
    )


class PoolClient:
    """See module docstring. Build with :func:`kvfabric.pool.connect` or an embedded pool."""

    def __init__(
        self,
        transport: Transport,
        platform: Platform,
        *,
        window_bytes: int = 0,
        window_medium: Medium = Medium.DRAM,
        metadata_only: bool = False,
        local_reads: bool = True,
        client_id: str | None = None,
        verify: Verify | str | bool | None = None,
    ) -> None:
        self.transport = transport
        self.platform = platform
        self.client_id = client_id or f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.metadata_only = metadata_only
        self.local_reads = local_reads
        self.table: TableView | None = None
        self.fabric: Fabric | None = None
        self.dp: FabricDataPlane = None  # type: ignore[assignment]
        self.rank: int | None = None
        self._window: Buffer | None = None
        self._epoch = 0
        self._closed = False
        self.writer = Writer(self)
        self.reader = Reader(self)
        info = self._call(p.Info()).data
        self.addr = FixedStride(info["stride"])
        self.write_lease_s = float(info.get("write_lease_s", 10.0))
        self.verify = Verify.parse(info.get("verify", "on") if verify is None else verify)
        try:
            if not metadata_only:
                if window_bytes:
                    self._window = platform.alloc(window_bytes, window_medium, shareable=True)
                self._join(info, rank=None)
            self._attach(info)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ plumbing
    def _call(self, req: Any) -> p.Reply:
        reply = self.transport.call(req)
        if self._epoch and reply.epoch != self._epoch:
            self._on_restart(reply.epoch)
        self._epoch = reply.epoch
        return reply

    def _join(self, info: dict[str, Any], rank: int | None, token: str | None = None) -> None:
        windows = {self._window.medium: self._window} if self._window is not None else {}
        self.fabric = Fabric.join(
            info["rendezvous"], self.platform, windows, rank=rank, config=gva_config(info), token=token
        )
        self.rank = self.fabric.rank
        self.fabric.on_evicted(lambda why: log.info("pool rank %s left the fabric: %s", self.rank, why))
        self.dp = FabricDataPlane(self.fabric)
        if self._window is not None:  # the service places objects here once it saw us join
            deadline = time.monotonic() + JOIN_VISIBLE_S
            while self.rank not in self.transport.call(p.Info()).data["ranks"]:
                if time.monotonic() > deadline:
                    log.warning("the pool service has not seen rank %s join yet", self.rank)
                    break
                time.sleep(0.01)

    def _attach(self, info: dict[str, Any]) -> None:
        """Map the service's directory table (same node only)."""
        if self.metadata_only and not self.local_reads:
            return
        if self.local_reads and (self.table is None or self.table.seg.name != info["table"]):
            old, self.table = self.table, None
            if old is not None:
                old.close()
            try:
                self.table = attach(info["table"], info["table_bytes"])
            except Exception as e:  # noqa: BLE001 - another node: no shared table, use RPC
                log.info("pool directory table not mapped (%s); reads use RPC leases", e)

    def _read(self, fn: Any, *args: Any) -> Any:
        """Run a read; if the service restarted under it (table retired), catch up once."""
        try:
            return fn(*args)
        except TableRetired:
            self.refresh()
            return fn(*args)

    def refresh(self) -> None:
        """Re-read the service's state (a restart is noticed and caught up with here)."""
        self._attach(self._call(p.Info()).data)

    def _on_restart(self, epoch: int) -> None:
        """The meta service restarted: rejoin its fabric and re-register the objects this
        client's window holds. A client with a window reclaims its rank with its previous
        token (the restarted daemon reserved the rank for it, so a client that rejoins
        first cannot take it); if the rank went to someone else anyway its objects are
        dropped, never re-registered at addresses of another rank. The new epoch is
        recorded by the caller only after this returns, so a catch-up that fails half-way
        is tried again on the next call."""
        log.warning("pool meta service restarted (epoch %x -> %x); rejoining", self._epoch, epoch)
        info = self.transport.call(p.Info()).data
        if self.fabric is not None:
            token = self.fabric.token
            try:
                self.fabric.leave()
            except Exception as e:  # noqa: BLE001 - its store died with the old service
                log.debug("leaving the old fabric: %s", e)
            if self._window is None:
                self._join(info, rank=None)
            else:
                try:
                    self._join(info, rank=self.rank, token=token)
                except ValueError as e:
                    log.warning(
                        "pool rank %s not reclaimed after the restart (%s); its window's objects are dropped",
                        self.rank,
                        e,
                    )
                    self.writer.forget()
                    self._join(info, rank=None)
        items = self.writer.owned_items()
        if items:
            keys = [k for k, _ in items]
            gv, sz, gn, sm = zip(*(v for _, v in items))
            self.transport.call(p.Reregister(keys, list(gv), list(sz), list(gn), list(sm)))
        self._attach(info)

    def in_own_window(self, gva: int) -> bool:
        if self.rank is None or self._window is None:
            return False
        lo = self.addr.encode(self._window.medium, self.rank, 0)
        return lo <= gva < lo + self._window.nbytes

    def _require_data(self) -> None:
        if self.metadata_only:
            raise ValueError("a metadata-only pool client cannot move object bytes")
        if self._closed:
            raise ValueError("pool client is closed")

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
        self.writer.forget(kb)
        return st

    def remove_all(self) -> int:
        self.writer.forget()
        return int(self._call(p.RemoveAll()).data["removed"])

    def info(self) -> dict[str, Any]:
        return dict(self._call(p.Info()).data)

    # ------------------------------------------------------------------ buffers
    def register_buffer(self, ptr: int, nbytes: int) -> Buffer:
        """Make caller memory usable by the zero-copy calls (pinned on device platforms).
        ``ValueError`` naming the argument when ``[ptr, ptr + nbytes)`` is not memory mapped
        readable in this process (checked once here, so a bogus address never reaches a copy)."""
        ptr, nbytes = check_int(ptr, "ptr", 1), check_int(nbytes, "nbytes", 1)
        check_mapped(ptr, nbytes, f"register_buffer(ptr={ptr:#x}, nbytes={nbytes})")
        return self.platform.register_host(ptr, nbytes)

    def unregister_buffer(self, buf: Buffer) -> None:
        self.platform.free(buf)

    # ------------------------------------------------------------------ writes
    def batch_alloc(
        self,
        keys: Sequence[str],
        sizes: Sequence[int],
        preferred_rank: int | None = None,
        medium: Medium | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Space for each key: ``(status, gva)``. Write pieces at ``gva + offset`` with
        :meth:`write`, then :meth:`batch_commit`; space not committed within the write
        lease is reclaimed."""
        return self.writer.batch_alloc(keys, sizes, preferred_rank, medium)

    def write(self, gvas: Any, ptrs: Any, sizes: Any) -> None:
        """Copy caller pieces ``ptrs[i]`` (``sizes[i]`` bytes) to ``gvas[i]``."""
        self.writer.write(gvas, ptrs, sizes)

    def batch_commit(
        self, keys: Sequence[str], ok: Sequence[bool] | None = None, ttl_s: float | None = None
    ) -> np.ndarray:
        return self.writer.batch_commit(keys, ok, ttl_s)

    def batch_put_from_layers(self, keys: Sequence[str], ptrs: Any, sizes: Any) -> np.ndarray:
        """Store each key from ``m`` pieces: ``ptrs`` is ``(k, m)``, ``sizes`` ``(m,)`` or
        ``(k, m)``. One alloc RPC, one batched copy, one commit RPC. Per-key statuses."""
        return self.writer.batch_put_from_layers(keys, ptrs, sizes)

    def put_from_layers(self, key: str, ptrs: Any, sizes: Any) -> Status:
        P, S = u64(ptrs, "ptrs")[None, :], u64(sizes, "sizes", positive=True)
        return _raise_put(key, Status(int(self.writer.batch_put_from_layers([key], P, S)[0])))

    def batch_put_from(self, keys: Sequence[str], ptrs: Any, sizes: Any) -> np.ndarray:
        P, S = u64(ptrs, "ptrs")[:, None], u64(sizes, "sizes", positive=True)[:, None]
        return self.writer.batch_put_from_layers(keys, P, S)

    def put_from(self, key: str, ptr: int, nbytes: int) -> Status:
        ptr, nbytes = check_int(ptr, "ptr", 1), check_int(nbytes, "nbytes", 1)
        return _raise_put(key, self.writer.put_one(key, ptr, nbytes))

    def batch_put(self, keys: Sequence[str], values: Sequence[bytes]) -> np.ndarray:
        return self.writer.batch_put(keys, values)

    def put(self, key: str, value: bytes) -> Status:
        encode_key(key)
        return _raise_put(key, Status(int(self.writer.batch_put([key], [value])[0])))

    # ------------------------------------------------------------------ gets
    def get_into(self, key: str, ptr: int, nbytes: int) -> int:
        """Copy the object into ``[ptr, ptr + nbytes)``; its size. ``KeyNotFound`` if absent."""
        ptr, nbytes = check_int(ptr, "ptr", 1), check_int(nbytes, "nbytes", 1)
        return self._read(self.reader.get_into, encode_key(key), ptr, nbytes)

    def get_into_layers(self, key: str, ptrs: Any, sizes: Any) -> int:
        P, S = u64(ptrs, "ptrs"), u64(sizes, "sizes", positive=True)
        return self._read(self.reader.get_into_layers, encode_key(key), P, S)

    def batch_get_into(self, keys: Sequence[str], ptrs: Any, sizes: Any) -> np.ndarray:
        P, S = u64(ptrs, "ptrs")[:, None], u64(sizes, "sizes", positive=True)[:, None]
        return self._read(self.reader.batch_get_into_layers, encode_keys(keys), P, S)

    def batch_get_into_layers(self, keys: Sequence[str], ptrs: Any, sizes: Any) -> np.ndarray:
        kb = encode_keys(keys)
        P = u64(ptrs, "ptrs").reshape(len(kb), -1)
        S = u64(sizes, "sizes", positive=True).reshape(np.shape(sizes))
        S = np.broadcast_to(S, P.shape) if S.ndim == 1 else S
        return self._read(self.reader.batch_get_into_layers, kb, P, S)

    def get(self, key: str) -> bytes:
        return self._read(self.reader.get, encode_key(key))

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        return [self._read(self.reader.get_or_none, k) for k in encode_keys(keys)]

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Leave the fabric (the service then drops this rank's objects) and release
        the window and the table. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.fabric is not None:
            try:
                self.fabric.leave()
            except Exception as e:  # noqa: BLE001 - closing: the service may be gone
                log.debug("leaving the pool fabric: %s", e)
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
