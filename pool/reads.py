"""``Reader``: how a pool client reads objects.

Local path (the directory table is mapped: same node): look the key up in shared memory
(C, no RPC), copy from the mapped window, then re-read the slot's sequence counter; if it
moved, the object was removed or its space reused during the copy and the copy is
discarded (retried a few times, then reported as a miss). Readers mark recency in the
table themselves.

Remote path (no table): ``lookup`` RPC with a read lease, copy, ``release`` RPC; a lease
that ran out and lost its object turns the read into ``LeaseExpired``, never wrong bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvfabric.errors import KeyNotFound, LeaseExpired, TransferFailed
from kvfabric.pool import protocol as p
from kvfabric.pool.dataplane import require
from kvfabric.pool.status import Status
from kvfabric.pool.table import SlotState, ticks_passed

if TYPE_CHECKING:
    from kvfabric.pool.client import PoolClient

RETRIES = 4
_READABLE = int(SlotState.READABLE)


class Reader:
    """The read side of one :class:`PoolClient` (see module docstring)."""

    def __init__(self, client: PoolClient) -> None:
        self.c = client

    # ------------------------------------------------------------------ exists
    def exists_local(self, keys: list[bytes]) -> np.ndarray:
        table = self.c.table
        idx, out = table.lookup_many(keys)  # type: ignore[union-attr]
        live = (idx >= 0) & (out[:, 4] == _READABLE)
        exp = live & (out[:, 5] != 0)
        for k in np.flatnonzero(exp).tolist():
            if ticks_passed(int(out[k, 5])):
                live[k] = False
        return live

    # ------------------------------------------------------------------ single gets
    def get_into(self, key: bytes, ptr: int, nbytes: int) -> int:
        """The hot path of a single zero-copy read (no arrays, no RPC on the node)."""
        c = self.c
        c._require_data()
        if nbytes <= 0:
            raise ValueError(f"buffer size must be > 0, got {nbytes}")
        host_user = c.dp.check_user_one(ptr, nbytes)
        table = c.table
        if table is None:
            return self._rpc_get(
                key, np.array([ptr], np.uint64), np.array([nbytes], np.uint64), host_user, exact=False
            )
        for _ in range(RETRIES):
            i, (seq, gva, size, _gen, state, expire) = table.lookup_raw(key)
            if i < 0 or state != _READABLE or (expire and ticks_passed(expire)):
                raise KeyNotFound(f"pool key {key.decode(errors='replace')!r} not found")
            _check_size(key, size, nbytes, exact=False)
            if not c.dp.read_one(ptr, gva, size, host_user):
                continue  # its rank is gone or the copy failed: look again
            if table.seq_now(i) == seq:
                table.touch(i)
                return size
        raise KeyNotFound(f"pool key {key.decode(errors='replace')!r} kept changing while being read")

    def get_into_layers(self, key: bytes, ptrs: np.ndarray, sizes: np.ndarray, exact: bool = True) -> int:
        c = self.c
        c._require_data()
        host_user = c.dp.check_user(ptrs, sizes)
        table = c.table
        if table is None:
            return self._rpc_get(key, ptrs, sizes, host_user, exact)
        want = int(sizes.sum())
        for _ in range(RETRIES):
            hit = table.lookup(key)
            if hit is None or hit.state != SlotState.READABLE or (hit.expire and ticks_passed(hit.expire)):
                raise KeyNotFound(f"pool key {key.decode(errors='replace')!r} not found")
            _check_size(key, hit.size, want, exact)
            self._copy_out(hit.gva, hit.size, ptrs, sizes, host_user)
            if table.seq_now(hit.slot) == hit.seq:
                table.touch(hit.slot)
                return hit.size
        raise KeyNotFound(f"pool key {key.decode(errors='replace')!r} kept changing while being read")

    def _copy_out(self, gva: int, size: int, ptrs: np.ndarray, sizes: np.ndarray, host_user: bool) -> None:
        """Scatter the object at ``gva`` into the caller's pieces (``TransferFailed`` if not)."""
        offs = np.cumsum(sizes) - sizes
        n = np.minimum(sizes, np.maximum(np.int64(size) - offs.astype(np.int64), 0).astype(np.uint64))
        keep = n > 0
        require(self.c.dp.read(ptrs[keep], np.uint64(gva) + offs[keep], n[keep]), "pool read")

    def get(self, key: bytes) -> bytes:
        out = self.get_or_none(key)
        if out is None:
            raise KeyNotFound(f"pool key {key.decode(errors='replace')!r} not found")
        return out

    def get_or_none(self, key: bytes) -> bytes | None:
        c = self.c
        c._require_data()
        for _ in range(RETRIES):
            size = self._peek_size(key)
            if size is None:
                return None
            staging = np.empty(size, np.uint8)
            buf = c.platform.wrap(staging)
            try:
                got = self.get_into(key, staging.ctypes.data, size)
            except KeyNotFound:
                return None
            except ValueError:
                continue  # replaced by a bigger object meanwhile
            finally:
                c.platform.free(buf)
            return staging[:got].tobytes()
        return None

    def _peek_size(self, key: bytes) -> int | None:
        c = self.c
        if c.table is not None:
            hit = c.table.lookup(key)
            return hit.size if hit is not None and hit.state == SlotState.READABLE else None
        r = c._call(p.Lookup([key], lease=False))
        return r.sizes[0] if r.status[0] == Status.OK else None

    # ------------------------------------------------------------------ batch gets
    def batch_get_into_layers(self, keys: list[bytes], P: np.ndarray, S: np.ndarray) -> np.ndarray:
        """Per-key status; objects whose size differs from the pieces' total are INVALID."""
        c = self.c
        c._require_data()
        if P.shape != S.shape or P.shape[0] != len(keys):
            raise ValueError(f"ptrs {P.shape} / sizes {S.shape} do not match {len(keys)} keys")
        status = np.full(len(keys), Status.NOT_FOUND, np.int8)
        if not keys:
            return status
        host_user = c.dp.check_user(P.reshape(-1), S.reshape(-1))
        table = c.table
        if table is None:
            for k, key in enumerate(keys):
                status[k] = self._rpc_status(key, P[k], S[k], host_user)
            return status
        idx, out = table.lookup_many(keys)
        hit = (idx >= 0) & (out[:, 4] == _READABLE)
        for k in np.flatnonzero(hit & (out[:, 5] != 0)).tolist():
            hit[k] = not ticks_passed(int(out[k, 5]))
        want = S.sum(axis=1)
        bad = hit & (out[:, 2] != want)
        status[bad] = Status.INVALID
        hit &= ~bad
        if hit.any():
            Sh = np.ascontiguousarray(S[hit])
            offs = np.cumsum(Sh, axis=1) - Sh
            g = (out[hit, 1][:, None] + offs).reshape(-1)
            arrived = c.dp.read(np.ascontiguousarray(P[hit]).reshape(-1), g, Sh.reshape(-1))
            changed = (table.seq_many(idx[hit]) != out[hit, 0]) | ~arrived.reshape(Sh.shape[0], -1).all(
                axis=1
            )
            status[np.flatnonzero(hit)[~changed]] = Status.OK
            table.touch_many(idx[hit][~changed])
            for k in np.flatnonzero(hit)[changed].tolist():  # rare: retry one by one
                try:
                    self.get_into_layers(keys[k], P[k], S[k])
                    status[k] = Status.OK
                except KeyNotFound:
                    status[k] = Status.NOT_FOUND
                except TransferFailed:
                    status[k] = Status.TRANSFER_FAILED
        return status

    # ------------------------------------------------------------------ remote path
    def _rpc_get(self, key: bytes, ptrs: np.ndarray, sizes: np.ndarray, host_user: bool, exact: bool) -> int:
        c = self.c
        r = c._call(p.Lookup([key], lease=True))
        if r.status[0] != Status.OK:
            raise KeyNotFound(f"pool key {key.decode(errors='replace')!r} not found")
        try:
            _check_size(key, r.sizes[0], int(sizes.sum()), exact)
            self._copy_out(r.gvas[0], r.sizes[0], ptrs, sizes, host_user)
        finally:
            rel = c._call(p.Release([r.lease_ids[0]])).status[0]
        if rel != Status.OK:
            raise LeaseExpired(
                f"read lease of pool key {key.decode(errors='replace')!r} expired during the copy; "
                "the bytes read are not trusted"
            )
        return int(r.sizes[0])

    def _rpc_status(self, key: bytes, ptrs: np.ndarray, sizes: np.ndarray, host_user: bool) -> int:
        try:
            self._rpc_get(key, ptrs, sizes, host_user, exact=True)
            return Status.OK
        except KeyNotFound:
            return Status.NOT_FOUND
        except LeaseExpired:
            return Status.LEASE_EXPIRED
        except ValueError:
            return Status.INVALID


def _check_size(key: bytes, size: int, want: int, exact: bool) -> None:
    if (exact and size != want) or size > want:
        raise ValueError(
            f"pool key {key.decode(errors='replace')!r} holds {size} B; the buffers given hold {want} B"
        )
