"""``StoreTask``: the task every store in this package hands out, and its life cycle.

A task is a per-block status array plus the bookkeeping that makes ``wait``, ``cancel``
and timeouts safe for the caller's memory:

* Jobs (run on a store's worker threads) claim *chunks* of the task's blocks from a
  cursor, so submitting a task costs O(worker threads), not O(blocks).
* Every access to the caller's memory (a copy into or out of ``addrs``) and every commit
  that makes a block visible runs inside ``with task.guard() as ok:``; ``ok`` is False once
  the task is cancelled, and the job must then skip the access (and discard what it was
  about to publish). ``cancel`` takes the same lock, so when it returns no access to the
  caller's memory is running or will start: a copy that was already running finishes
  first (it cannot be recalled from a device queue), slower private work (file I/O) does
  not delay it.
* ``wait`` is single-consumer; it returns a copy of the statuses in which blocks that were
  not finished read as the cancellation status (``CANCELLED`` or ``TIMEOUT``).
* Children: a pipeline's task adopts the tasks it starts in lower stores; cancelling the
  parent cancels them first.
* The task is a :class:`kvfabric.status.Handle` (``Task``'s ``check`` / ``wait`` /
  ``cancel``), ``wait_finished`` waiting on the task's condition variable.

Thread-safe throughout.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from kvfabric.status import pending
from kvfabric.ucm_layer.store.base import BlockStatus, Task, TaskKind

_PENDING = int(BlockStatus.PENDING)


class StoreTask(Task):
    """One load or dump (see module docstring). ``store`` is the store that made it."""

    def __init__(self, store: Any, kind: TaskKind, num_blocks: int, chunk: int = 1) -> None:
        self.store = store
        self.kind = kind
        self.num_blocks = int(num_blocks)
        self.status = pending(self.num_blocks)
        self.chunk = max(1, int(chunk))
        self._cond = threading.Condition()
        self._guard = threading.RLock()
        self._cursor = 0
        self._jobs = 0
        self._sealed = False
        self._done = False
        self._finishing = False
        self._cancel: BlockStatus | None = None
        self._released = False
        self._consumed = False
        self._children: list[tuple[Any, Task]] = []
        self._on_done: list[Callable[[StoreTask], None]] = []
        #: per-block digests of verified loads into host memory (see ``record_digest``)
        self.digests: np.ndarray | None = None

    # ------------------------------------------------------------------ jobs
    def add_job(self) -> None:
        with self._cond:
            self._jobs += 1

    def seal(self) -> None:
        """No more jobs will be added; with none outstanding the task is done now."""
        with self._cond:
            self._sealed = True
        self._maybe_done()

    def job_done(self) -> None:
        with self._cond:
            self._jobs -= 1
        self._maybe_done()

    def _maybe_done(self) -> None:
        with self._cond:
            if not (self._sealed and self._jobs == 0) or self._finishing:
                return
            self._finishing = True
            # a job that ended without a verdict for some block failed it (defensive)
            leftover = BlockStatus.FAILED if self._cancel is None else self._cancel
            self.status[self.status == _PENDING] = int(leftover)
            callbacks, self._on_done = self._on_done, []
        for fn in callbacks:  # outside the lock, before waiters see the task done
            fn(self)
        with self._cond:
            self._done = True
            self._cond.notify_all()

    def next_chunk(self) -> slice | None:
        """The next ``chunk`` blocks to work on, or None when all are taken or cancelled."""
        with self._cond:
            if self._cancel is not None or self._cursor >= self.num_blocks:
                return None
            lo = self._cursor
            self._cursor = min(lo + self.chunk, self.num_blocks)
            return slice(lo, self._cursor)

    def on_done(self, fn: Callable[[StoreTask], None]) -> None:
        """Run ``fn(task)`` once the task is done (now, if it already is); ``fn`` runs before
        ``wait`` sees the task done, so it must not wait on the task."""
        with self._cond:
            if not self._finishing:
                self._on_done.append(fn)
                return
        fn(self)

    # ------------------------------------------------------------------ statuses
    def set(self, where: Any, status: BlockStatus | np.ndarray) -> None:
        """Set the status of blocks ``where`` (an index, slice, mask or index array)."""
        self.status[where] = status

    def record_digest(self, i: int, digest: int) -> None:
        """Block ``i`` was verified on the host and its bytes, now in the caller's memory,
        digest to ``digest``: a pipeline filling a cache slot seals it with this instead of
        hashing the slot again. ``digests`` stays None until a store records one."""
        if self.digests is None:
            self.digests = np.zeros(self.num_blocks, np.uint64)
        self.digests[i] = digest

    def fail_pending(self, where: Any = slice(None)) -> None:
        """Blocks of ``where`` that are still pending become ``FAILED`` (an unexpected error)."""
        sub = self.status[where]
        sub[sub == _PENDING] = int(BlockStatus.FAILED)
        self.status[where] = sub

    # ------------------------------------------------------------------ caller memory
    @contextlib.contextmanager
    def guard(self) -> Iterator[bool]:
        """Hold while touching the caller's memory or committing; yields False if cancelled."""
        with self._guard:
            yield self._cancel is None and not self._released

    @property
    def cancelled(self) -> BlockStatus | None:
        return self._cancel

    def cancel(self, status: BlockStatus = BlockStatus.CANCELLED) -> None:
        """Cancel children, then stop: when this returns no caller-memory access runs."""
        with self._cond:
            if self._finishing or self._cancel is not None:
                return
            self._cancel = status
            children = list(self._children)
            self._cond.notify_all()
        for store, child in children:
            store.cancel(child)
        with self._guard:
            self._released = True
        with self._cond:
            self._cond.notify_all()

    def adopt(self, store: Any, child: Task) -> None:
        """Track ``child`` (a task of ``store``) so cancelling this task cancels it."""
        with self._cond:
            cancelled = self._cancel is not None
            if not cancelled:
                self._children.append((store, child))
        if cancelled:
            store.cancel(child)

    # ------------------------------------------------------------------ completion
    @property
    def done(self) -> bool:
        return self._done

    def finished(self) -> bool:
        """Done, or cancelled and released (what ``check`` reports)."""
        return self._done or self._released

    def wait_finished(self, timeout: float | None) -> bool:
        """Block until ``finished()`` or ``timeout`` passed; whether it finished."""
        with self._cond:
            return self._cond.wait_for(self.finished, timeout)

    def consume(self) -> None:
        with self._cond:
            if self._consumed:
                raise ValueError("this task was already waited on (wait has a single consumer)")
            self._consumed = True

    def result(self) -> np.ndarray:
        """A copy of the statuses, unfinished blocks reading as the cancellation status."""
        with self._cond:
            out = self.status.copy()
            if not self._done:
                out[out == _PENDING] = int(self._cancel or BlockStatus.CANCELLED)
        return out

    def __repr__(self) -> str:
        state = "done" if self._done else ("cancelled" if self._cancel else "running")
        return f"StoreTask({self.kind.value}, {self.num_blocks} blocks, {state})"


def check_task(task: Any, store: object) -> StoreTask:
    """``task`` must be a :class:`StoreTask` made by ``store``."""
    if not isinstance(task, StoreTask) or task.store is not store:
        raise ValueError(f"{task!r} is not a task of this store ({store!r})")
    return task


def wait_task(store: object, task: Any, timeout: float | None) -> np.ndarray:
    """The contract's ``wait``: single consumer; on timeout cancel with ``TIMEOUT``."""
    t = check_task(task, store)
    if timeout is not None and timeout < 0:
        raise ValueError(f"timeout must be >= 0 seconds or None, got {timeout}")
    t.consume()
    if not t.wait_finished(timeout):
        t.cancel(BlockStatus.TIMEOUT)
    return t.result()
