"""``TaskStore``: what the stores of this package share on top of the contract.

Argument checking (ids, shard index, address matrix against the platform's live buffers
at the configured piece sizes, the ``after`` event), task creation with per-status
counters, ``check`` / ``wait`` / ``cancel`` on :class:`StoreTask`, and the one place a
store reports blocks that failed verification (``_corrupt_found``: counted in
``stats()["corrupt_blocks"]``, logged once per store). A store subclass implements
``lookup``, ``_start_load`` and ``_start_dump``.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvfabric.platform.base import Platform
from kvfabric.platform.checksum import Verify
from kvfabric.platform.stream import Event
from kvfabric.status import BLOCK_STATUSES, ItemStatus, counts
from kvfabric.ucm_layer.store.base import (
    Store,
    StoreLayout,
    Task,
    TaskKind,
    check_addrs,
    check_after,
    check_ids,
    check_ranges,
    check_shard,
)
from kvfabric.ucm_layer.store.task import StoreTask, check_task, wait_task

if TYPE_CHECKING:
    from kvfabric.ucm_layer.store.workers import WorkerContext, Workers

log = logging.getLogger("kvfabric.store")

CLOSE_GRACE_S = 10.0  # how long close() lets outstanding tasks finish before cancelling them


@dataclass(frozen=True)
class Request:
    """A checked load or dump: ids, shard, ``(n, m)`` addresses and their media codes."""

    ids: np.ndarray
    shard: int
    addrs: np.ndarray
    media: np.ndarray
    after: Event | None = None

    @property
    def n(self) -> int:
        return int(self.ids.shape[0])

    def host_contiguous(self, layout: StoreLayout) -> bool:
        """Every shard is one contiguous run of host (DRAM) memory."""
        if self.n == 0 or self.media.any():
            return False
        if layout.pieces == 1:
            return True
        step = np.diff(self.addrs, axis=1)
        return bool((step == layout.sizes[:-1]).all())


class TaskStore(Store):
    """Common machinery of the stores in this package (see module docstring)."""

    #: the threads that run the store's jobs (stores that start their own tasks leave it None)
    workers: Workers | None = None

    def __init__(self, platform: Platform, layout: StoreLayout) -> None:
        if not isinstance(platform, Platform):
            raise TypeError(f"a store needs a kvfabric Platform, got {type(platform).__name__}")
        if not isinstance(layout, StoreLayout):
            raise TypeError(f"a store needs a StoreLayout, got {type(layout).__name__}")
        self.platform = platform
        self.layout = layout
        self._closed = False
        self._stats_lock = threading.Lock()
        self._counts = {k: np.zeros(len(ItemStatus), np.int64) for k in TaskKind}
        self._live: weakref.WeakSet[StoreTask] = weakref.WeakSet()
        self._corrupt = 0
        self._corrupt_logged = False
        #: whether loads check the writers' checksums (the store's ``verify`` key; see set_verify)
        self.verify = Verify.ON

    # ------------------------------------------------------------------ checks
    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"store {self.name!r} is closed")

    def _request(self, ids: Any, shard_idx: int, addrs: Any, after: Any = None) -> Request:
        self._check_open()
        arr = check_ids(ids)
        shard = check_shard(shard_idx, self.layout)
        a = check_addrs(addrs, arr.shape[0], self.layout)
        media = check_ranges(self.platform, a, self.layout) if a.size else np.zeros(a.shape, np.uint8)
        return Request(arr, shard, a, media, check_after(after, self.platform))

    def _ids(self, ids: Any) -> np.ndarray:
        self._check_open()
        return check_ids(ids)

    def _new_task(self, kind: TaskKind, n: int, chunk: int = 1) -> StoreTask:
        task = StoreTask(self, kind, n, chunk)
        task.on_done(self._count)
        self._live.add(task)
        return task

    def _settle(self, timeout: float | None = None) -> None:
        """For ``close``: let outstanding tasks finish for up to ``timeout`` seconds (default
        ``CLOSE_GRACE_S``), then cancel the rest (e.g. a dump waiting on an event that never
        comes)."""
        deadline = time.monotonic() + (CLOSE_GRACE_S if timeout is None else timeout)
        for task in list(self._live):
            if not task.wait_finished(max(0.0, deadline - time.monotonic())):
                task.cancel(ItemStatus.CANCELLED)

    def set_verify(self, verify: Verify | str | bool) -> None:
        """Switch checksum verification of loads (for benchmarks and tests: between tasks; a
        load already queued may run under either setting). Writers always seal."""
        self.verify = Verify.parse(verify)

    def _corrupt_found(self, count: int, where: str) -> None:
        """``count`` blocks failed verification here (``where`` names one, for the log):
        counted in ``stats()["corrupt_blocks"]``; logged the first time only."""
        if count <= 0:
            return
        with self._stats_lock:
            self._corrupt += count
            first, self._corrupt_logged = not self._corrupt_logged, True
        if first:
            log.warning(
                "store %s: %d block(s) failed checksum verification (e.g. %s); reported CORRUPT, "
                "dropped so the next dump rewrites them (further ones are only counted: corrupt_blocks)",
                self.name,
                count,
                where,
            )

    def _count(self, task: StoreTask) -> None:
        c = counts(task.status)
        with self._stats_lock:
            self._counts[task.kind] += c

    # ------------------------------------------------------------------ contract
    def load(self, ids: np.ndarray, shard_idx: int, addrs: np.ndarray) -> Task:
        req = self._request(ids, shard_idx, addrs)
        task = self._new_task(TaskKind.LOAD, req.n, self._chunk_blocks())
        self._start_load(req, task)
        return task

    def dump(self, ids: np.ndarray, shard_idx: int, addrs: np.ndarray, after: Any = None) -> Task:
        req = self._request(ids, shard_idx, addrs, after)
        task = self._new_task(TaskKind.DUMP, req.n, self._chunk_blocks())
        self._start_dump(req, task)
        return task

    def _chunk_blocks(self) -> int:
        return 1 << 30  # one chunk: the whole call (stores that split work override)

    def _start_load(self, req: Request, task: StoreTask) -> None:
        """Start a checked load. Default: the whole call is one job on the store's workers,
        ``self._load(ctx, req, task)``; stores that split calls into chunks override."""
        self._one_job(task, lambda ctx: self._load(ctx, req, task))  # type: ignore[attr-defined]

    def _start_dump(self, req: Request, task: StoreTask) -> None:
        """Start a checked dump; the default runs ``self._dump(ctx, req, task)`` as one job."""
        self._one_job(task, lambda ctx: self._dump(ctx, req, task))  # type: ignore[attr-defined]

    def _one_job(self, task: StoreTask, job: Callable[[WorkerContext], None]) -> None:
        if self.workers is None:
            raise NotImplementedError(f"store {self.name!r} has no workers: it starts its own tasks")
        self.workers.submit(task, job)
        task.seal()

    def check(self, task: Task) -> bool:
        return check_task(task, self).finished()

    def wait(self, task: Task, timeout: float | None = None) -> np.ndarray:
        return wait_task(self, task, timeout)

    def cancel(self, task: Task) -> None:
        check_task(task, self).cancel(ItemStatus.CANCELLED)

    def stats(self) -> dict[str, int]:
        out: dict[str, int] = {}
        with self._stats_lock:
            for kind, tally in self._counts.items():
                for st in BLOCK_STATUSES:
                    if st is not ItemStatus.PENDING:
                        out[f"{kind.value}_{st.name.lower()}"] = int(tally[st])
            out["corrupt_blocks"] = self._corrupt
        return out

    def close(self) -> None:
        """Let outstanding tasks finish (cancelling what is left after ``CLOSE_GRACE_S``),
        stop the workers, then release what the store holds (``_release``). Idempotent;
        afterwards every call but ``close`` and ``stats`` raises ``ValueError``."""
        if self._closed:
            return
        self._closed = True
        try:
            self._settle()
            if self.workers is not None:
                self.workers.close()
        finally:
            self._release()

    def _release(self) -> None:
        """What the store holds beyond its tasks and workers (buffers, clients, tiers)."""

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.name}, {self.layout.pieces} piece(s), {self.layout.shard_bytes} B)"
        )
