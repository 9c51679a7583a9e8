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

Replicas: an object may have further extents (``pool/service/replicas.py``): on the node,
replica slots the reader probes after the primary; elsewhere, the ``lookup`` reply's
``replicas``. A read takes the extents in this order: mapped here first, then ranks not
suspected, then the rest; a rank whose copy just failed is suspected for ``SUSPECT_S``.
An extent whose copy fails, whose slot changed, or whose bytes fail the checksum is
passed over for the next one (a corrupt extent is removed alone: ``Remove`` with its
gva; the object goes with its last extent); when none serves, the read is a miss (or
corrupt, when one failed its checksum) — never bytes that were not checked.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import numpy as np

from kvfabric.errors import CorruptObject, KeyNotFound, LeaseExpired, TransferFailed
from kvfabric.platform import checksum
from kvfabric.platform.checksum import Verify
from kvfabric.pool import protocol as p
from kvfabric.pool.client.dataplane import require
from kvfabric.pool.client.session import Session
from kvfabric.pool.keys import key_text
from kvfabric.pool.status import Status
from kvfabric.pool.table import SlotState, TableView, ticks_passed

RETRIES = 4
SUSPECT_S = 5.0  # a rank whose copy failed is tried last for this long
_READABLE = int(SlotState.READABLE)
_REPLICA = int(SlotState.REPLICA)
log = logging.getLogger("kvfabric.pool")


class Reader:
    """The read side of one pool client, over its :class:`Session` (see module docstring)."""

    def __init__(self, session: Session) -> None:
        self.c = session
        self.corrupt = 0  # reads whose bytes did not match the writer's checksum
        self.unverified = 0  # reads that could not be checked (no checksum, or device memory afar)
        self.fallbacks = 0  # reads served by another extent than the first one tried
        self._suspect: dict[int, float] = {}  # rank -> until (monotonic): its copies failed

    # ------------------------------------------------------------------ extents
    def _rank(self, gva: int) -> int:
        return int(self.c.addr.decode(gva)[1])

    def suspect(self, gva: int) -> None:
        """A copy from ``gva`` failed: its rank goes last for ``SUSPECT_S``."""
        self._suspect[self._rank(gva)] = time.monotonic() + SUSPECT_S

    def _suspected(self, gva: int) -> bool:
        until = self._suspect.get(self._rank(gva))
        return until is not None and until > time.monotonic()

    def _order(self, gvas: list[int], size: int) -> list[int]:
        """Extents in the order a read tries them (see module docstring)."""
        if len(gvas) < 2:
            return gvas
        return sorted(gvas, key=lambda g: (self.c.dp.local(g, size) is None, self._suspected(g)))

    def _local_extents(
        self, table: TableView, key: bytes, first: tuple[int, int, int], size: int, skip: set[int]
    ) -> Iterator[tuple[int, int, int]]:
        """``(slot, seq, gva)`` of each extent of ``key`` on the node's table but those at
        ``skip``, in the order a read tries them; the replica slots are probed only when the
        first extent is not mapped here or did not serve."""
        near = self.c.dp.local(first[2], size) is not None and not self._suspected(first[2])
        if near and first[2] not in skip:
            yield first
        found = [] if near or first[2] in skip else [first]
        for i in range(1, p.MAX_REPLICAS):
            j, f = table.lookup_raw(p.replica_key(key, i))
            if j < 0:
                break
            if f[4] == _REPLICA and f[2] == size and f[1] not in skip:
                found.append((j, f[0], f[1]))
        by_gva = {e[2]: e for e in found}
        for g in self._order(list(by_gva), size):
            yield by_gva[g]

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
            c.call(p.Remove([key], gvas=[gva]))  # this extent; the object with its last one
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
        corrupt: set[int] = set()  # extents that failed the checksum (each removed alone)
        failed: set[int] = set()  # extents whose copy failed in this call (not tried again)
        for _ in range(RETRIES):
            i, (seq, gva, size, _gen, state, expire, csum) = table.lookup_raw(key)
            if i < 0 or state != _READABLE or (expire and ticks_passed(expire)):
                break
            _check_size(key, size, nbytes, exact=False)
            cands = list(self._local_extents(table, key, (i, seq, gva), size, corrupt | failed))
            if not cands:
                break
            for n, (si, sq, g) in enumerate(cands):
                if not c.dp.read_one(ptr, g, size, host_user):
                    self.suspect(g)
                    failed.add(g)
                    continue  # its rank is gone or the copy failed: the next extent
                if table.seq_now(si) != sq:
                    break  # the directory changed under the copy: look again
                if not self._intact(key, csum, [(ptr, size)], g, size, host_user):
                    corrupt.add(g)
                    break  # removed alone (another extent may take its place): look again
                self.fallbacks += bool(n or corrupt or failed)
                table.touch(i)
                table.count_reads(1, 1, size)
                return size
        return self._no_read(table, key, bool(corrupt), None)

    def _no_read(self, table: TableView, key: bytes, corrupt: bool, failed: TransferFailed | None) -> int:
        """No extent served (see module docstring): count it and raise what it was."""
        if corrupt:
            table.count_reads(1, corrupt=1)
            raise _corrupt(key)
        table.count_reads(1)
        if failed is not None:
            raise failed
        raise KeyNotFound(f"pool key '{key_text(key)}' not found or kept changing while being read")

    def get_into_layers(self, key: bytes, ptrs: np.ndarray, sizes: np.ndarray, exact: bool = True) -> int:
        c = self.c
        c.require_data()
        host_user = c.dp.check_user(ptrs, sizes)
        table = c.table
        if table is None:
            return self._rpc_get(key, ptrs, sizes, host_user, exact)
        want = int(sizes.sum())
        error: TransferFailed | None = None
        corrupt: set[int] = set()
        failed: set[int] = set()
        for _ in range(RETRIES):
            hit = table.lookup(key)
            if hit is None or hit.state != SlotState.READABLE or (hit.expire and ticks_passed(hit.expire)):
                break
            _check_size(key, hit.size, want, exact)
            first = (hit.slot, hit.seq, hit.gva)
            cands = list(self._local_extents(table, key, first, hit.size, corrupt | failed))
            if not cands:
                break
            for n, (si, sq, g) in enumerate(cands):
                try:
                    ranges = self._copy_out(g, hit.size, ptrs, sizes, host_user)
                except TransferFailed as e:
                    self.suspect(g)
                    failed.add(g)
                    error = e
                    continue
                if table.seq_now(si) != sq:
                    break
                if not self._intact(key, hit.csum, ranges, g, hit.size, host_user):
                    corrupt.add(g)
                    break
                self.fallbacks += bool(n or corrupt or failed)
                table.touch(hit.slot)
                table.count_reads(1, 1, hit.size)
                return hit.size
        return self._no_read(table, key, bool(corrupt), error)

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
            except (KeyNotFound, TransferFailed, LeaseExpired):
                return None  # no extent served: a miss
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
                more = table.lookup_raw(p.replica_key(keys[k], 1))[0] >= 0  # before _intact drops one
                if self._intact(keys[k], int(out[k, 6]), ranges, int(out[k, 1]), int(out[k, 2]), host_user):
                    status[k] = Status.OK
                elif more:
                    changed[r] = True  # another extent may serve: one by one below
                else:
                    status[k] = Status.CORRUPT
            for r in np.flatnonzero(changed).tolist():
                if not arrived.reshape(Sh.shape[0], -1)[r].all():
                    self.suspect(int(out[int(rows[r]), 1]))
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
        size = int(r.sizes[0])
        csum = r.sums[0] if r.sums else 0
        gvas = self._order([int(r.gvas[0]), *(r.replicas[0] if r.replicas else [])], size)
        served, bad, failed = False, 0, None
        try:
            _check_size(key, size, int(sizes.sum()), exact)
            for n, g in enumerate(gvas):
                try:
                    ranges = self._copy_out(g, size, ptrs, sizes, host_user)
                except TransferFailed as e:
                    self.suspect(g)
                    failed = e
                    continue
                if self._intact(key, csum, ranges, g, size, host_user):  # checked under the lease
                    served = True
                    self.fallbacks += n > 0
                    break
                bad += 1
        finally:
            rel = c.call(p.Release([r.lease_ids[0]])).status[0]
        if not served:
            if bad:
                raise _corrupt(key)
            raise failed if failed is not None else KeyNotFound(f"pool key '{key_text(key)}' not found")
        if rel != Status.OK:
            raise LeaseExpired(
                f"read lease of pool key '{key_text(key)}' expired during the copy; "
                "the bytes read are not trusted"
            )
        return size

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
        except TransferFailed:
            return Status.TRANSFER_FAILED
        except ValueError:
            return Status.INVALID


def _corrupt(key: bytes) -> CorruptObject:
    return CorruptObject(f"pool key '{key_text(key)}': the bytes read do not match its writer's checksum")


def _check_size(key: bytes, size: int, want: int, exact: bool) -> None:
    if (exact and size != want) or size > want:
        raise ValueError(f"pool key '{key_text(key)}' holds {size} B; the buffers given hold {want} B")
