"""``cache``: a fixed-slot host-memory tier, on its own or above another store.

Memory: one platform DRAM buffer (pinned, or registered where the platform pins host
memory; in shared memory when ``cache.shared``) cut into slots of one block shard each.
The index is a :class:`~kvfabric.ucm_layer.store.cache_index.SlotTable` (hash index,
per-slot refcount, ready flag, LRU that never evicts a slot in use). At start the store
checks that the configured capacity fits (free space of the shared-memory directory for
a shared cache, available memory otherwise) and fails with ``OutOfSpace`` naming both
figures if not.

On its own, a load copies every present shard of the call into place with one
``batch_copy`` (absent ones are ``MISSING``), and a dump claims slots, copies into them
with one ``batch_copy`` after ``after``, and marks them ready. A full cache (every slot
in use) makes a dump ``FAILED``. In a pipeline (``pipeline.py``), the same slot
operations let a miss be filled once from the store below while concurrent loads of
the same block wait for that fill instead of repeating it.

The index is private to the process; ``cache.shared`` only places the slots in shared
memory (sized against ``KVFABRIC_SHM_DIR``).

Integrity: whoever fills a slot (a dump, or a pipeline's fill from the store below)
records the xxh3 digest of the slot's bytes before publishing it (``seal``). With
``cache.verify`` on, a load hashes each hit slot on the host while the batched copy out
of it runs (on a device, the copy engine's DMA; on the sim platform, the stream's
thread) and reports a mismatch ``CORRUPT``; the slot is dropped from the index.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from kvfabric.errors import KVFabricError, OutOfSpace
from kvfabric.platform import shm
from kvfabric.platform.base import Platform
from kvfabric.platform.checksum import Verify, digest_range
from kvfabric.platform.stream import Stream
from kvfabric.platform.types import Medium
from kvfabric.settings import Size, setting
from kvfabric.ucm_layer.store.base import BlockStatus, StoreLayout
from kvfabric.ucm_layer.store.cache_index import Claim, Claims, SlotTable, keys_of
from kvfabric.ucm_layer.store.common import Request, TaskStore
from kvfabric.ucm_layer.store.config import StoreConfig
from kvfabric.ucm_layer.store.task import StoreTask
from kvfabric.ucm_layer.store.workers import WorkerContext, Workers, copy_pieces, dump_may_start, slot_pieces

SLOT_ALIGN = 64
SETTLE_POLL_S = 0.05


@dataclass(frozen=True)
class CacheConfig(StoreConfig):
    """Configuration of the cache store (keys ``cache.*``; see docs/stores.md)."""

    PREFIX: ClassVar[str] = "cache"

    capacity: Size = setting(doc="bytes of host memory for slots, e.g. 4GiB")
    shared: bool = setting(False, doc="put the slots in shared memory (KVFABRIC_SHM_DIR)")
    workers: int = setting(2, doc="threads that run the cache's copies", lo=1, hi=64)
    prefault: bool = setting(False, doc="touch every page at start (no page faults later)")
    verify: Verify = setting(Verify.ON, doc="loads check each slot's checksum (on / off)")


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def check_fits(capacity: int, shared: bool) -> None:
    """``OutOfSpace`` when ``capacity`` bytes of cache cannot fit where they would live."""
    if shared:
        where = shm.shm_dir()
        try:
            free: int | None = shutil.disk_usage(where).free
        except OSError as e:
            raise OutOfSpace(f"shared cache: shared-memory directory {where!r} is unusable: {e}") from e
        what = f"free in {where} (a shared cache lives there; enlarge the tmpfs or lower cache.capacity)"
    else:
        free = _mem_available()
        what = "of available memory (lower cache.capacity)"
    if free is not None and capacity > free:
        raise OutOfSpace(f"cache.capacity of {capacity} B does not fit: only {free} B {what}")


class CacheStore(TaskStore):
    """The cache store (see module docstring)."""

    name = "cache"

    def __init__(self, config: CacheConfig, *, platform: Platform, layout: StoreLayout) -> None:
        super().__init__(platform, layout)
        self.config = config
        self.slot_bytes = -(-layout.shard_bytes // SLOT_ALIGN) * SLOT_ALIGN
        slots = config.capacity // self.slot_bytes
        if slots < 1:
            raise ValueError(
                f"cache.capacity of {config.capacity} B holds no slot: "
                f"one block shard takes {self.slot_bytes} B"
            )
        nbytes = slots * self.slot_bytes
        check_fits(nbytes, config.shared)
        try:
            self.buffer = platform.alloc(nbytes, Medium.DRAM, shareable=config.shared)
        except OutOfSpace as e:
            raise OutOfSpace(f"cache of {slots} slots ({nbytes} B) could not be allocated: {e}") from e
        if config.prefault:
            self.buffer.numpy()[::4096] = 0
        self.table = SlotTable(slots)
        self._offsets, self._sizes = layout.offsets, layout.sizes
        self.verify = config.verify
        self.workers = Workers(platform, config.workers, "kvfabric-cache")

    @classmethod
    def from_config(cls, config: Mapping[str, Any], **kwargs: Any) -> CacheStore:
        return cls(CacheConfig.from_mapping(config), **kwargs)

    # ------------------------------------------------------------------ slot operations
    def slot_addrs(self, slots: np.ndarray) -> np.ndarray:
        """``(k, m)`` piece addresses of ``slots``."""
        bases = self.buffer.ptr + np.asarray(slots, np.uint64) * np.uint64(self.slot_bytes)
        return slot_pieces(bases, self._offsets)

    def _sizes_for(self, k: int) -> np.ndarray:
        return np.broadcast_to(self._sizes, (k, self.layout.pieces))

    def copy_out(
        self, stream: Stream, slots: np.ndarray, addrs: np.ndarray, verify: bool = False
    ) -> np.ndarray:
        """Every piece of ``slots`` to ``addrs`` (``(k, m)``) in one batched copy; with
        ``verify``, each slot is hashed while the copy runs. Returns the ``(k,)`` mask of
        slots whose bytes do not match their recorded digest (all False without verify).
        Raises ``KVFabricError`` when the copy fails."""
        bad = copy_pieces(
            self.platform,
            stream,
            addrs,
            self.slot_addrs(slots),
            self._sizes_for(len(slots)),
            (lambda: self.digests(slots) != self.table.digest[slots]) if verify and len(slots) else None,
        )
        return np.zeros(len(slots), bool) if bad is None else bad

    def digests(self, slots: np.ndarray) -> np.ndarray:
        """The digests of the bytes now in ``slots``."""
        base, step, n = self.buffer.ptr, self.slot_bytes, self.layout.shard_bytes
        return np.fromiter((digest_range(base + s * step, n) for s in slots.tolist()), np.uint64, len(slots))

    def seal(self, slots: np.ndarray, known: np.ndarray | None = None) -> None:
        """Record the digests of ``slots`` (FILLING, owned by the caller) before publishing;
        ``known``: digests already computed over exactly these bytes (0 where not)."""
        if not len(slots):
            return
        if known is None or not known.all():
            fresh = self.digests(slots)
            known = fresh if known is None else np.where(known != 0, known, fresh)
        self.table.digest[slots] = known

    def drop(self, slots: np.ndarray) -> None:
        """``slots`` (pinned by the caller) failed verification: out of the index, counted."""
        if len(slots):
            self.table.discard(slots)
            self._corrupt_found(len(slots), f"cache slot {int(slots[0])}")

    def copy_in(self, stream: Stream, slots: np.ndarray, addrs: np.ndarray) -> None:
        """Every piece at ``addrs`` (``(k, m)``) into ``slots`` in one batched copy."""
        copy_pieces(self.platform, stream, self.slot_addrs(slots), addrs, self._sizes_for(len(slots)))

    def acquire(self, ids: np.ndarray, shard: int, claim: bool) -> Claims:
        return self.table.acquire(keys_of(ids, shard), ids, shard, claim)

    def claim_write(self, ids: np.ndarray, shard: int) -> Claims:
        return self.table.claim_write(keys_of(ids, shard), ids, shard)

    def wait_settled(self, ids: np.ndarray, shard: int, task: StoreTask) -> bool:
        """Wait until none of ``ids`` is being filled; False if ``task`` got cancelled."""
        keys = keys_of(ids, shard)
        while task.cancelled is None:
            if self.table.wait_settled(keys, ids, shard, SETTLE_POLL_S):
                return True
        return False

    # ------------------------------------------------------------------ contract
    def lookup(self, ids: np.ndarray) -> np.ndarray:
        return self.table.present(self._ids(ids), self.layout.num_shards)

    def _load(self, ctx: WorkerContext, req: Request, task: StoreTask) -> None:
        c = self.acquire(req.ids, req.shard, claim=False)
        hit = c.rows(Claim.HIT)
        try:
            task.set(np.flatnonzero(c.kinds != Claim.HIT), BlockStatus.MISSING)
            if hit.size:
                with task.guard() as ok:
                    if ok:
                        try:
                            bad = self.copy_out(
                                ctx.stream, c.slots[hit], req.addrs[hit], self.verify is Verify.ON
                            )
                            task.set(hit, np.where(bad, BlockStatus.CORRUPT, BlockStatus.OK).astype(np.int8))
                            self.drop(c.slots[hit[bad]])
                        except KVFabricError:
                            task.set(hit, BlockStatus.FAILED)
        finally:
            self.table.release(c.slots[hit])

    def _dump(self, ctx: WorkerContext, req: Request, task: StoreTask) -> None:
        if not dump_may_start(req.after, task, ctx.stream):
            return
        pending = np.arange(req.n)
        while pending.size:
            c = self.claim_write(req.ids[pending], req.shard)
            task.set(pending[c.kinds == Claim.HIT], BlockStatus.OK)
            task.set(pending[c.kinds == Claim.NONE], BlockStatus.FAILED)  # every slot in use
            own = c.rows(Claim.OWN)
            if own.size:
                self.fill_from(ctx.stream, task, c, own, req.addrs[pending], pending)
            wait = c.rows(Claim.WAIT)
            if wait.size and not self.wait_settled(req.ids[pending[wait]], req.shard, task):
                return
            pending = pending[wait]

    def fill_from(
        self, stream: Stream, task: StoreTask, c: Claims, own: np.ndarray, addrs: np.ndarray, rows: np.ndarray
    ) -> bool:
        """Copy the caller's memory (``addrs``, indexed like ``c``) into the OWN slots of ``c``
        (rows ``own``; one copy per slot) and publish them, all under ``task``'s guard, and set
        the statuses of task blocks ``rows[own]``. A cancelled task frees the slots and sets
        nothing. True when the slots became ready."""
        lead = own[c.first[own]]
        slots = c.slots[lead]
        with task.guard() as go:
            ok = False
            if go:
                try:
                    self.copy_in(stream, slots, addrs[lead])
                    self.seal(slots)
                    ok = True
                except KVFabricError:
                    task.set(rows[own], BlockStatus.FAILED)
            self.table.publish(slots, np.full(slots.size, ok))
            if ok:
                task.set(rows[own], BlockStatus.OK)
        return ok

    def stats(self) -> dict[str, int]:
        return {**super().stats(), **self.table.counts()}

    def _release(self) -> None:
        self.platform.free(self.buffer)
