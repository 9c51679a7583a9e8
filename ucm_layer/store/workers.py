"""Worker threads of a store and the transfer steps every store shares.

``Workers`` is a fixed pool of daemon threads. Each thread owns a platform stream (copies
on one thread never queue behind another thread's) and optional per-thread scratch (the
posix store's bounce area). ``run(task, fn)`` starts at most one job per thread; each job
pulls chunks of the task's blocks from the task's cursor, so a call costs O(threads)
Python work on the caller's thread whatever the number of blocks.

A job that raises marks the blocks of its chunk ``FAILED`` (and logs once), so an
unexpected error is a per-block failure, never a crash and never a hung ``wait``.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from kvfabric.errors import KVFabricError
from kvfabric.platform.base import Platform
from kvfabric.platform.stream import Event, Stream
from kvfabric.platform.types import CopyBatch
from kvfabric.ucm_layer.store.base import BlockStatus
from kvfabric.ucm_layer.store.task import StoreTask

log = logging.getLogger("kvfabric.store")

T = TypeVar("T")
AFTER_POLL_S = 0.05  # how often a job waiting on ``after`` looks at its task's cancel flag


@dataclass
class WorkerContext:
    """What a job gets: its thread's index, stream and scratch."""

    index: int
    stream: Stream
    scratch: Any = None


ChunkFn = Callable[[WorkerContext, slice], None]
JobFn = Callable[[WorkerContext], None]


class Workers:
    """A pool of ``threads`` daemon threads (see module docstring)."""

    def __init__(
        self,
        platform: Platform,
        threads: int,
        name: str,
        scratch: Callable[[int], Any] | None = None,
        release: Callable[[Any], None] | None = None,
    ) -> None:
        if threads < 1:
            raise ValueError(f"a store needs at least one worker thread, got {threads}")
        self.platform = platform
        self.threads = threads
        self._queue: queue.SimpleQueue[tuple[StoreTask, Callable[[WorkerContext], None]] | None] = (
            queue.SimpleQueue()
        )
        self._release = release
        self._contexts: list[WorkerContext] = []
        self._ready = threading.Barrier(threads + 1)
        self._errors: list[BaseException] = []
        self._threads = [
            threading.Thread(target=self._main, args=(i, scratch), name=f"{name}-{i}", daemon=True)
            for i in range(threads)
        ]
        for t in self._threads:
            t.start()
        self._ready.wait()
        if self._errors:
            self.close()
            raise self._errors[0]
        self._closed = False

    def _main(self, index: int, scratch: Callable[[int], Any] | None) -> None:
        try:
            ctx = WorkerContext(index, self.platform.stream(), scratch(index) if scratch else None)
            self._contexts.append(ctx)
        except BaseException as e:  # noqa: BLE001 - reported by the constructor
            self._errors.append(e)
            self._ready.wait()
            return
        self._ready.wait()
        while True:
            item = self._queue.get()
            if item is None:
                return
            task, job = item
            try:
                job(ctx)
            except BaseException as e:
                log.exception("store job failed: %s", e)
                task.fail_pending()
            finally:
                task.job_done()

    def submit(self, task: StoreTask, fn: JobFn) -> None:
        """Run ``fn(ctx)`` once on some worker as a job of ``task`` (the caller seals)."""
        if getattr(self, "_closed", False):
            raise ValueError("the store is closed")
        task.add_job()
        self._queue.put((task, fn))

    def run(self, task: StoreTask, fn: ChunkFn) -> None:
        """Process every chunk of ``task`` with ``fn(ctx, chunk)`` on up to all threads; seal."""
        chunks = -(-task.num_blocks // task.chunk)
        for _ in range(min(self.threads, chunks)):
            self.submit(task, lambda ctx: _drain(task, fn, ctx))
        task.seal()

    def close(self) -> None:
        """Finish queued jobs, stop the threads, close their streams. Idempotent."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join()
        while True:  # a job queued while closing never runs: its blocks fail
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].fail_pending()
                item[0].job_done()
        for ctx in self._contexts:
            try:
                ctx.stream.close()
            finally:
                if self._release is not None and ctx.scratch is not None:
                    self._release(ctx.scratch)


def _drain(task: StoreTask, fn: ChunkFn, ctx: WorkerContext) -> None:
    while (chunk := task.next_chunk()) is not None:
        try:
            fn(ctx, chunk)
        except Exception as e:
            log.exception("store job failed on blocks %s: %s", chunk, e)
            task.fail_pending(chunk)


# ---------------------------------------------------------------------------- transfer steps
def wait_after(after: Event | None, task: StoreTask, stream: Stream) -> BlockStatus | None:
    """Wait on the host until ``after`` completes, watching ``task``'s cancel flag; then order
    ``stream`` behind it too. None when the dump may go on, else the status to report."""
    if after is None:
        return None
    while True:
        if task.cancelled is not None:
            return task.cancelled
        try:
            after.synchronize(AFTER_POLL_S)
            break
        except TimeoutError:
            continue
        except KVFabricError as e:
            log.warning("the work a dump waited on failed: %s", e)
            return BlockStatus.FAILED
    stream.wait_event(after)
    return None


def dump_may_start(after: Event | None, task: StoreTask, stream: Stream, sl: slice = slice(None)) -> bool:
    """``wait_after`` for a dump worker: True when it may go on; False when it must stop, its
    blocks (``sl``, default all pending) already marked FAILED if the awaited work failed."""
    verdict = wait_after(after, task, stream)
    if verdict is BlockStatus.FAILED:
        task.fail_pending(sl)
    return verdict is None


def copy_pieces(
    platform: Platform,
    stream: Stream,
    dst: np.ndarray,
    src: np.ndarray,
    sizes: np.ndarray,
    during: Callable[[], T] | None = None,
) -> T | None:
    """One batched copy of ``(dst, src, sizes)`` (arrays of equal shape) on ``stream``, then
    wait for it. ``during`` runs while the copy is in flight (checksums of the source on the
    host then overlap the copy engine, or the sim platform's stream thread) and its result
    is returned; the copy is waited for even when it raises. Raises ``KVFabricError``
    (``TransferFailed`` ...) when the copy fails."""
    if dst.size:
        platform.batch_copy(CopyBatch(dst.reshape(-1), src.reshape(-1), sizes.reshape(-1)), stream=stream)
    try:
        return during() if during is not None else None
    finally:
        if dst.size:
            stream.synchronize()


def slot_pieces(bases: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """``(k, m)`` piece addresses of ``k`` contiguous slots starting at ``bases``."""
    return np.asarray(bases, np.uint64).reshape(-1, 1) + np.asarray(offsets, np.uint64).reshape(1, -1)
