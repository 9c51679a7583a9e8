"""``Reader``: how a pool client reads objects.

Local path (the directory table is mapped: same node): look the key up in shared memory
(C, no RPC), copy from the mapped window, then re-read the slot's sequence counter; if it
moved, the object was removed or its space reused during the copy and the copy is
discarded (retried a few times, then reported as a miss). Readers mark recency in the
table themselves.

Remote path (no table): ``lookup`` RPC with a read lease, copy, ``release`` RPC; a lease
that ran out and lost its object turns the read into ``LeaseExpired``, never wrong bytes.

Both paths then check the bytes against the writer's checksum (the slot's ``csum``, or
the lookup reply's) when ``verify`` is on: over the caller's memory when it is host
memory, else over the mapped window (device memory read from another node is counted as
``unverified``). A mismatch is ``CorruptObject`` / ``Status.CORRUPT``: a miss, counted,
logged once, and the object removed so the next put rewrites it.
"""

from __future__ import annotations

import logging

import numpy as np

from kvfabric.errors import CorruptObject, KeyNotFound, LeaseExpired, TransferFailed
from kvfabric.platform import checksum
from kvfabric.platform.checksum import Verify
from kvfabric.pool import protocol as p
from kvfabric.pool.client.dataplane import require
from kvfabric.pool.client.session import Session
from kvfabric.pool.keys import key_text
from kvfabric.pool.status import Status
from kvfabric.pool.table import SlotState, ticks_passed

RETRIES = 4
_READABLE = int(SlotState.READABLE)
log = logging.getLogger("kvfabric.pool")


class Reader:
    """The read side of one pool client, over its :class:`Session` (see module docstring)."""

    def __init__(self, session: Session) -> None:
        self.c = session
        self.corrupt = 0  # reads whose bytes did not match the writer's checksum
        self.unverified = 0  # reads that could not be checked (no checksum, or device memory afar)

    # ------------------------------------------------------------------ integrity
    def _intact(
        self, key: bytes, csum: int, ranges: list[tuple[int, int]], gva: int, size: int, host_user: bool
    ) -> bool:
        """Whether what was just copied matches the writer's checksum (see module docstring)."""
        c = self.c
        if c.verify is Verify.OFF:
            return True
        if not csum:
            self.unverified += 1
            return True
        if host_user:
            got = checksum.digest_ranges(ranges)
        else:
            loc = c.dp.local(gva, size)
            if loc is None or not loc[1]:
                self.unverified += 1
                return True
            got = checksum.digest_range(loc[0], size)
        if got == csum:
            return True
        self.corrupt += 1
        (log.warning if self.corrupt == 1 else log.debug)(
            "pool key '%s': the bytes read do not match its writer's checksum (%#x != %#x); served as a "
            "miss and removed%s",
            key_text(key),
            got,
            csum,
            "" if self.corrupt == 1 else f" ({self.corrupt} so far)",
        )
        try:
            c.call(p.Remove([key]))
        except Exception as e:  # noqa: BLE001 - best effort: the read is a miss either way
            log.debug("removing corrupt pool key '%s': %s", key_text(key), e)
        return False

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
        c.require_data()
        if nbytes <= 0:
            raise ValueError(f"buffer size must be > 0, got {nbytes}")
        host_user = c.dp.check_user_one(ptr, nbytes)
        table = c.table
        if table is None:
            return self._rpc_get(
                key, np.array([ptr], np.uint64), np.array([nbytes], np.uint64), host_user, exact=False
            )
        for _ in range(RETRIES):
            i, (seq, gva, size, _gen, state, expire, csum) = table.lookup_raw(key)
            if i < 0 or state != _READABLE or (expire and ticks_passed(expire)):
                table.count_reads(1)
                raise KeyNotFound(f"pool key '{key_text(key)}' not found")
            _check_size(key, size, nbytes, exact=False)
            if not c.dp.read_one(ptr, gva, size, host_user):
                continue  # its rank is gone or the copy failed: look again
            if table.seq_now(i) == seq:
                if not self._intact(key, csum, [(ptr, size)], gva, size, host_user):
                    table.count_reads(1, corrupt=1)
                    raise _corrupt(key)
                table.touch(i)
                table.count_reads(1, 1, size)
                return size
        table.count_reads(1)
        raise KeyNotFound(f"pool key '{key_text(key)}' kept changing while being read")

    def get_into_layers(self, key: bytes, ptrs: np.ndarray, sizes: np.ndarray, exact: bool = True) -> int:
        c = self.c
        c.require_data()
        host_user = c.dp.check_user(ptrs, sizes)
        table = c.table
        if table is None:
            return self._rpc_get(key, ptrs, sizes, host_user, exact)
        want = int(sizes.sum())
        for _ in range(RETRIES):
            hit = table.lookup(key)
            if hit is None or hit.state != SlotState.READABLE or (hit.expire and ticks_passed(hit.expire)):
                table.count_reads(1)
                raise KeyNotFound(f"pool key '{key_text(key)}' not found")
            _check_size(key, hit.size, want, exact)
            ranges = self._copy_out(hit.gva, hit.size, ptrs, sizes, host_user)
            if table.seq_now(hit.slot) == hit.seq:
                if not self._intact(key, hit.csum, ranges, hit.gva, hit.size, host_user):
                    table.count_reads(1, corrupt=1)
                    raise _corrupt(key)
                table.touch(hit.slot)
                table.count_reads(1, 1, hit.size)
                return hit.size
        table.count_reads(1)
        raise KeyNotFound(f"pool key '{key_text(key)}' kept changing while being read")

    def _copy_out(
        self, gva: int, size: int, ptrs: np.ndarray, sizes: np.ndarray, host_user: bool
    ) -> list[tuple[int, int]]:
        """Scatter the object at ``gva`` into the caller's pieces (``TransferFailed`` if
        not); the ``(ptr, n)`` ranges written, in object order."""
        offs = np.cumsum(sizes) - sizes
        n = np.minimum(sizes, np.maximum(np.int64(size) - offs.astype(np.int64), 0).astype(np.uint64))
        keep = n > 0
        require(self.c.dp.read(ptrs[keep], np.uint64(gva) + offs[keep], n[keep]), "pool read")
        return list(zip(ptrs[keep].tolist(), n[keep].tolist()))

    def get(self, key: bytes) -> bytes:
        out = self.get_or_none(key)
        if out is None:
            raise KeyNotFound(f"pool key '{key_text(key)}' not found")
        return out

    def get_or_none(self, key: bytes) -> bytes | None:
        c = self.c
        c.require_data()
        for _ in range(RETRIES):
            size = self._peek_size(key)
            if size is None:
                if c.table is not None:
                    c.table.count_reads(1)  # an on-node read that missed
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
        r = c.call(p.Lookup([key], lease=False))
        return r.sizes[0] if r.status[0] == Status.OK else None

    # ------------------------------------------------------------------ batch gets
    def batch_get_into_layers(self, keys: list[bytes], P: np.ndarray, S: np.ndarray) -> np.ndarray:
        """Per-key status; objects whose size differs from the pieces' total are INVALID."""
        c = self.c
        c.require_data()
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
        retried = np.zeros(len(keys), bool)  # counted by get_into_layers, one by one
        if hit.any():
            Sh = np.ascontiguousarray(S[hit])
            offs = np.cumsum(Sh, axis=1) - Sh
            g = (out[hit, 1][:, None] + offs).reshape(-1)
            arrived = c.dp.read(np.ascontiguousarray(P[hit]).reshape(-1), g, Sh.reshape(-1))
            changed = (table.seq_many(idx[hit]) != out[hit, 0]) | ~arrived.reshape(Sh.shape[0], -1).all(
                axis=1
            )
            rows = np.flatnonzero(hit)
            Ph = P[hit]
            for r in np.flatnonzero(~changed).tolist():
                k = int(rows[r])
                ranges = list(zip(Ph[r].tolist(), Sh[r].tolist()))
                if self._intact(keys[k], int(out[k, 6]), ranges, int(out[k, 1]), int(out[k, 2]), host_user):
                    status[k] = Status.OK
                else:
                    status[k] = Status.CORRUPT
            table.touch_many(idx[status == Status.OK])
            retried[rows[changed]] = True
            for k in rows[changed].tolist():  # rare: retry one by one
                try:
                    self.get_into_layers(keys[k], P[k], S[k])
                    status[k] = Status.OK
                except CorruptObject:
                    status[k] = Status.CORRUPT
                except KeyNotFound:
                    status[k] = Status.NOT_FOUND
                except TransferFailed:
                    status[k] = Status.TRANSFER_FAILED
        done = ~retried
        ok = done & (status == Status.OK)
        corrupt = int((done & (status == Status.CORRUPT)).sum())
        table.count_reads(int(done.sum()), int(ok.sum()), int(out[ok, 2].sum()), corrupt)
        return status

    # ------------------------------------------------------------------ remote path
    def _rpc_get(self, key: bytes, ptrs: np.ndarray, sizes: np.ndarray, host_user: bool, exact: bool) -> int:
        c = self.c
        r = c.call(p.Lookup([key], lease=True))
        if r.status[0] != Status.OK:
            raise KeyNotFound(f"pool key '{key_text(key)}' not found")
        try:
            _check_size(key, r.sizes[0], int(sizes.sum()), exact)
            ranges = self._copy_out(r.gvas[0], r.sizes[0], ptrs, sizes, host_user)
        finally:
            rel = c.call(p.Release([r.lease_ids[0]])).status[0]
        if rel != Status.OK:
            raise LeaseExpired(
                f"read lease of pool key '{key_text(key)}' expired during the copy; "
                "the bytes read are not trusted"
            )
        csum = r.sums[0] if r.sums else 0
        if not self._intact(key, csum, ranges, r.gvas[0], r.sizes[0], host_user):
            raise _corrupt(key)
        return int(r.sizes[0])

    def _rpc_status(self, key: bytes, ptrs: np.ndarray, sizes: np.ndarray, host_user: bool) -> int:
        try:
            self._rpc_get(key, ptrs, sizes, host_user, exact=True)
            return Status.OK
        except CorruptObject:
            return Status.CORRUPT
        except KeyNotFound:
            return Status.NOT_FOUND
        except LeaseExpired:
            return Status.LEASE_EXPIRED
        except ValueError:
            return Status.INVALID


def _corrupt(key: bytes) -> CorruptObject:
    return CorruptObject(f"pool key '{key_text(key)}': the bytes read do not match its writer's checksum")


def _check_size(key: bytes, size: int, want: int, exact: bool) -> None:
    if (exact and size != want) or size > want:
        raise ValueError(f"pool key '{key_text(key)}' holds {size} B; the buffers given hold {want} B")
