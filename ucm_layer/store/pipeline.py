"""Pipelines: a cache tier above one store (``"cache|posix"``, and ``"cache|pool"`` once the
pool store is registered), itself a store with the same contract.

* ``lookup`` / ``lookup_prefix``: the cache first; only its misses go down.
* ``load``: cache hits are copied out at once (one batched copy) while the misses load
  from the store below. With ``pipeline.promote`` (default) a miss claims a cache slot,
  the lower store fills the slot, the slot is marked ready and copied out: a concurrent
  load of the same block finds the slot being filled and waits for it instead of loading
  it again. Without a free or evictable slot a miss loads straight into the caller's
  memory.
* ``dump``: the caller's pieces are copied into claimed slots (one batched copy), then
  the lower store writes from the slots. ``pipeline.write = "through"`` (default): the
  task completes when the lower store has the blocks, with its statuses.
  ``"behind"``: the task completes once the bytes are in the cache (the caller's buffers
  are free, blocks read ``OK``) and the lower write goes on in the background; a failure
  there is counted (``behind_failed``) and logged. Either way a block becomes visible
  only once the lowest tier has it: the slots stay in filling state (invisible) until
  then. Blocks for which no slot is free go straight to the lower store.
* Cancelling or timing out a pipeline task cancels the tasks it started below.
* Integrity: a block the lower store reports ``CORRUPT`` (or any other failure) is not
  promoted: its claimed slot is freed and the status passes through. Slots filled here
  (from below or by a dump) are sealed with their digest before they become ready; cache
  hits are verified as in the cache alone. ``stats()["corrupt_blocks"]`` adds the tiers'.

The pipeline owns its two tiers and closes them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from kvfabric.errors import KVFabricError
from kvfabric.platform.checksum import Verify
from kvfabric.settings import setting
from kvfabric.ucm_layer.store.base import BlockStatus, Store, Task, TaskKind
from kvfabric.ucm_layer.store.cache import CacheStore
from kvfabric.ucm_layer.store.cache_index import Claim, Claims
from kvfabric.ucm_layer.store.common import Request, TaskStore
from kvfabric.ucm_layer.store.config import StoreConfig
from kvfabric.ucm_layer.store.task import StoreTask
from kvfabric.ucm_layer.store.workers import WorkerContext, Workers, dump_may_start

log = logging.getLogger("kvfabric.store.pipeline")
OK = BlockStatus.OK


@dataclass(frozen=True)
class PipelineConfig(StoreConfig):
    """Configuration of a pipeline (keys ``pipeline.*``; see docs/stores.md)."""

    PREFIX: ClassVar[str] = "pipeline"

    write: str = setting(
        "through", doc="dumps complete when the lower store has them", choices=("through", "behind")
    )
    promote: bool = setting(True, doc="loads that miss the cache fill it from the lower store")
    workers: int = setting(
        4, doc="threads running pipeline tasks (each waits on the lower store)", lo=1, hi=256
    )


def _by_slot(lead_slots: np.ndarray, lead_values: np.ndarray, row_slots: np.ndarray) -> np.ndarray:
    """The value of each row's lead (rows and leads matched by slot)."""
    order = np.argsort(lead_slots)
    return lead_values[order][np.searchsorted(lead_slots[order], row_slots)]


class Pipeline(TaskStore):
    """A cache above one store (see module docstring)."""

    def __init__(self, config: PipelineConfig, upper: Store, lower: Store) -> None:
        if not isinstance(upper, CacheStore):
            raise TypeError(f"the upper tier of a pipeline must be a cache store, got {type(upper).__name__}")
        if upper.platform is not lower.platform:
            raise ValueError("the tiers of a pipeline must share one platform instance")
        if upper.layout != lower.layout:
            raise ValueError(f"the tiers' layouts differ: {upper.layout} vs {lower.layout}")
        super().__init__(lower.platform, lower.layout)
        self.config = config
        self.upper, self.lower = upper, lower
        self.name = f"{upper.name}|{lower.name}"
        self.workers = Workers(self.platform, config.workers, "kvfabric-pipeline")
        self._background = StoreTask(self, TaskKind.DUMP, 0)  # accounts background jobs
        self._behind_failed = 0

    # ------------------------------------------------------------------ lookups
    def lookup(self, ids: np.ndarray) -> np.ndarray:
        arr = self._ids(ids)
        mask = self.upper.lookup(arr)
        miss = np.flatnonzero(~mask)
        if miss.size:
            mask[miss] = self.lower.lookup(arr[miss])
        return mask

    def lookup_prefix(self, ids: np.ndarray) -> int:
        arr = self._ids(ids)
        miss = np.flatnonzero(~self.upper.lookup(arr))
        if not miss.size:
            return int(arr.shape[0])
        q = self.lower.lookup_prefix(arr[miss])
        return int(miss[q]) if q < miss.size else int(arr.shape[0])

    def prefetch(self, ids: np.ndarray) -> None:
        """Fill cache slots from the lower store in the background (best effort)."""
        arr = self._ids(ids)
        if not self.config.promote:
            self.lower.prefetch(arr)
            return
        probe = StoreTask(self, TaskKind.LOAD, 0)
        for shard in range(self.layout.num_shards):
            self.workers.submit(self._background, lambda ctx, s=shard: self._fill(ctx, probe, arr, s))

    def _fill(self, ctx: WorkerContext, task: StoreTask, ids: np.ndarray, shard: int) -> None:
        c = self.upper.acquire(ids, shard, claim=True)
        self.upper.table.release(c.slots[c.kinds == Claim.HIT])
        own = c.rows(Claim.OWN)
        if own.size:
            _, ok = self._fill_own(task, c, own, ids, shard)
            self.upper.table.release(c.slots[own[ok]])

    def _fill_own(
        self, task: StoreTask, c: Claims, own: np.ndarray, ids: np.ndarray, shard: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Load the OWN rows' blocks from below into their slots and publish them. Returns
        per-row (of ``own``) lower statuses and whether each row's slot became ready; the
        pins of failed rows are dropped, those of ready rows are still held."""
        lead = own[c.first[own]]
        slots = c.slots[lead]
        st = np.full(lead.size, int(BlockStatus.FAILED), np.int8)
        try:
            sub = self.lower.load(ids[lead], shard, self.upper.slot_addrs(slots))
            task.adopt(self.lower, sub)
            st = self.lower.wait(sub)
            good = st == OK  # only verified bytes are promoted, sealed with the digest the lower
            known = getattr(sub, "digests", None)  # store found, when it checked them on the host
            self.upper.seal(slots[good], None if known is None else known[good])
        finally:
            self.upper.table.publish(slots, st == OK, pinned=c.slots[own])
        rows_st = _by_slot(slots, st, c.slots[own])
        return rows_st, rows_st == OK

    def _abandon(self, c: Claims, own: np.ndarray, pinned: bool) -> None:
        """Free the OWN slots of ``c`` after an error (no filling slot is ever left behind)."""
        if own.size:
            lead = own[c.first[own]]
            self.upper.table.publish(
                c.slots[lead], np.zeros(lead.size, bool), c.slots[own] if pinned else None
            )

    # ------------------------------------------------------------------ load
    def _copy_out(
        self,
        ctx: WorkerContext,
        task: StoreTask,
        slots: np.ndarray,
        addrs: np.ndarray,
        rows: np.ndarray,
        verify: bool = True,
    ) -> None:
        """Copy cache slots out to the caller; ``verify`` (hits; not slots this task just
        filled and sealed) checks them first when the cache verifies."""
        if not rows.size:
            return
        with task.guard() as ok:
            if not ok:
                return
            try:
                bad = self.upper.copy_out(ctx.stream, slots, addrs, verify and self.upper.verify is Verify.ON)
                task.set(rows, np.where(bad, BlockStatus.CORRUPT, OK).astype(np.int8))
                self.upper.drop(slots[bad])
            except KVFabricError as e:
                log.warning("pipeline: copy out of the cache failed: %s", e)
                task.set(rows, BlockStatus.FAILED)

    def _sub(
        self, task: StoreTask, kind: TaskKind, ids: np.ndarray, shard: int, addrs: np.ndarray
    ) -> Task | None:
        if not ids.shape[0]:
            return None
        if kind is TaskKind.LOAD:
            sub = self.lower.load(ids, shard, addrs)
        else:
            sub = self.lower.dump(ids, shard, addrs)
        task.adopt(self.lower, sub)
        return sub

    def _load(self, ctx: WorkerContext, req: Request, task: StoreTask) -> None:
        pending = np.arange(req.n)
        while pending.size and task.cancelled is None:
            ids, addrs = req.ids[pending], req.addrs[pending]
            c = self.upper.acquire(ids, req.shard, claim=self.config.promote)
            hit, own, none = c.rows(Claim.HIT), c.rows(Claim.OWN), c.rows(Claim.NONE)
            try:
                direct = self._sub(task, TaskKind.LOAD, ids[none], req.shard, addrs[none])
                self._copy_out(ctx, task, c.slots[hit], addrs[hit], pending[hit])
            except BaseException:
                self._abandon(c, own, pinned=True)
                raise
            finally:
                self.upper.table.release(c.slots[hit])
            if own.size:
                rows_st, ok = self._fill_own(task, c, own, ids, req.shard)
                task.set(pending[own[~ok]], rows_st[~ok])
                try:
                    self._copy_out(ctx, task, c.slots[own[ok]], addrs[own[ok]], pending[own[ok]], False)
                finally:
                    self.upper.table.release(c.slots[own[ok]])
            if direct is not None:
                task.set(pending[none], self.lower.wait(direct))
            pending = pending[c.rows(Claim.WAIT)]
            if pending.size and not self.upper.wait_settled(req.ids[pending], req.shard, task):
                return

    # ------------------------------------------------------------------ dump
    def _dump(self, ctx: WorkerContext, req: Request, task: StoreTask) -> None:
        if not dump_may_start(req.after, task, ctx.stream):
            return
        pending = np.arange(req.n)
        while pending.size and task.cancelled is None:
            ids, addrs = req.ids[pending], req.addrs[pending]
            c = self.upper.claim_write(ids, req.shard)
            task.set(pending[c.kinds == Claim.HIT], OK)
            own, none = c.rows(Claim.OWN), c.rows(Claim.NONE)
            try:
                direct = self._sub(task, TaskKind.DUMP, ids[none], req.shard, addrs[none])
            except BaseException:
                self._abandon(c, own, pinned=False)
                raise
            if own.size:
                self._dump_own(ctx, task, c, own, ids, addrs, pending, req.shard)
            if direct is not None:
                task.set(pending[none], self.lower.wait(direct))
            pending = pending[c.rows(Claim.WAIT)]
            if pending.size and not self.upper.wait_settled(req.ids[pending], req.shard, task):
                return

    def _dump_own(
        self,
        ctx: WorkerContext,
        task: StoreTask,
        c: Claims,
        own: np.ndarray,
        ids: np.ndarray,
        addrs: np.ndarray,
        rows: np.ndarray,
        shard: int,
    ) -> None:
        lead = own[c.first[own]]
        slots = c.slots[lead]
        copied = False
        with task.guard() as go:
            if go:
                try:
                    self.upper.copy_in(ctx.stream, slots, addrs[lead])
                    self.upper.seal(slots)
                    copied = True
                except KVFabricError as e:
                    log.warning("pipeline: copy into the cache failed: %s", e)
                    task.set(rows[own], BlockStatus.FAILED)
        if not copied:
            self.upper.table.publish(slots, np.zeros(slots.size, bool))
            return
        try:
            sub = self.lower.dump(ids[lead], shard, self.upper.slot_addrs(slots))
        except BaseException:
            self.upper.table.publish(slots, np.zeros(slots.size, bool))
            raise
        if self.config.write == "behind":
            if not isinstance(sub, StoreTask):
                self.lower.wait(sub)
                raise TypeError(f"write-behind needs {self.lower.name!r} to return StoreTask tasks")
            task.set(rows[own], OK)
            # published by the lower task's completion, on its own thread: a pipeline worker
            # waiting for these slots to settle can never block their settling
            sub.on_done(lambda t: self._settle_behind(t, slots))
            return
        task.adopt(self.lower, sub)
        st = np.full(slots.size, int(BlockStatus.FAILED), np.int8)
        try:
            st = self.lower.wait(sub)
        finally:
            self.upper.table.publish(slots, st == OK)
        task.set(rows[own], _by_slot(slots, st, c.slots[own]))

    def _settle_behind(self, sub: StoreTask, slots: np.ndarray) -> None:
        ok = sub.status == OK
        self.upper.table.publish(slots, ok)
        failed = int((~ok).sum())
        if failed:
            with self._stats_lock:
                self._behind_failed += failed
            log.warning(
                "pipeline %s: %d block(s) written behind failed in %s", self.name, failed, self.lower.name
            )

    def set_verify(self, verify: Verify | str | bool) -> None:
        """Both tiers (see ``TaskStore.set_verify``)."""
        super().set_verify(verify)
        self.upper.set_verify(verify)
        self.lower.set_verify(verify)

    # ------------------------------------------------------------------ lifecycle
    def stats(self) -> dict[str, int]:
        out = super().stats()
        out["behind_failed"] = self._behind_failed
        for tier in (self.upper, self.lower):
            tier_stats = tier.stats()
            out["corrupt_blocks"] += tier_stats.get("corrupt_blocks", 0)
            out.update({f"{tier.name}.{k}": v for k, v in tier_stats.items()})
        return out

    def _release(self) -> None:
        """After tasks and writes behind (the workers') are done: close both tiers."""
        try:
            self.lower.close()  # first: writes behind still read from cache slots
        finally:
            self.upper.close()
