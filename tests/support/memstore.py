"""A small stateful in-memory ``Store`` following ``ucm_layer/store/base.py``, for tests.

Shards live in a dict as bytes; transfers run on one worker thread (so they are really
asynchronous), copy through ctypes between the caller's addresses (checked against the
platform's live buffers before anything is queued) and host memory, and report a status
per block. ``fail_next_loads`` makes the next N block loads fail (status FAILED).
"""

from __future__ import annotations

import ctypes
import queue
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvfabric.ucm_layer.store.base import (
    BlockStatus,
    Store,
    StoreLayout,
    Task,
    TaskKind,
    check_addrs,
    check_ids,
    check_shard,
)


@dataclass(eq=False)
class MemTask(Task):
    kind: TaskKind
    num_blocks: int
    ids: np.ndarray
    shard: int
    addrs: np.ndarray
    after: Any = None
    status: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int8))
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False
    waited: bool = False


class MemStore(Store):
    name = "mem"

    def __init__(self, layout: StoreLayout, platform: Any) -> None:
        self.layout = layout
        self.platform = platform
        self._data: dict[tuple[bytes, int], bytes] = {}
        self._lock = threading.Lock()
        self._q: queue.Queue[MemTask | None] = queue.Queue()
        self._worker = threading.Thread(target=self._run, daemon=True)
        self._worker.start()
        self.fail_next_loads = 0
        self.loads = 0
        self.dumps = 0
        self.closed = False

    # ------------------------------------------------------------------ contract
    def lookup(self, ids: np.ndarray) -> np.ndarray:
        ids = check_ids(ids)
        with self._lock:
            return np.array([(bytes(r), 0) in self._data for r in ids], dtype=bool)

    def _submit(self, kind: TaskKind, ids: Any, shard_idx: int, addrs: Any, after: Any = None) -> MemTask:
        if self.closed:
            raise ValueError("store is closed")
        ids = check_ids(ids)
        shard = check_shard(shard_idx, self.layout)
        addrs = check_addrs(addrs, len(ids), self.layout)
        for j, size in enumerate(self.layout.piece_sizes):  # every range must be platform memory
            for a in addrs[:, j]:
                self.platform.find(int(a), size)
        t = MemTask(
            kind, len(ids), ids, shard, addrs, after, status=np.full(len(ids), BlockStatus.PENDING, np.int8)
        )
        self._q.put(t)
        return t

    def load(self, ids: np.ndarray, shard_idx: int, addrs: np.ndarray) -> Task:
        return self._submit(TaskKind.LOAD, ids, shard_idx, addrs)

    def dump(self, ids: np.ndarray, shard_idx: int, addrs: np.ndarray, after: Any = None) -> Task:
        return self._submit(TaskKind.DUMP, ids, shard_idx, addrs, after)

    def check(self, task: Task) -> bool:
        return self._own(task).done.is_set()

    def wait(self, task: Task, timeout: float | None = None) -> np.ndarray:
        t = self._own(task)
        if t.waited:
            raise ValueError("task already waited for (one consumer)")
        t.waited = True
        if not t.done.wait(timeout):
            t.cancelled = True
            t.done.wait()
            t.status[t.status == BlockStatus.PENDING] = BlockStatus.TIMEOUT
        return t.status.copy()

    def cancel(self, task: Task) -> None:
        self._own(task).cancelled = True

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._q.put(None)
            self._worker.join()

    # ------------------------------------------------------------------ worker
    def _own(self, task: Task) -> MemTask:
        if not isinstance(task, MemTask):
            raise ValueError("not a task of this store")
        return task

    def _run(self) -> None:
        while (t := self._q.get()) is not None:
            if t.after is not None:
                t.after.synchronize()
            for i in range(t.num_blocks):
                if t.cancelled:
                    t.status[i:] = BlockStatus.CANCELLED
                    break
                key = (bytes(t.ids[i]), t.shard)
                if t.kind is TaskKind.DUMP:
                    self.dumps += 1
                    with self._lock:
                        if key not in self._data:
                            self._data[key] = b"".join(
                                ctypes.string_at(int(a), n)
                                for a, n in zip(t.addrs[i], self.layout.piece_sizes)
                            )
                    t.status[i] = BlockStatus.OK
                    continue
                self.loads += 1
                if self.fail_next_loads > 0:
                    self.fail_next_loads -= 1
                    t.status[i] = BlockStatus.FAILED
                    continue
                with self._lock:
                    blob = self._data.get(key)
                if blob is None:
                    t.status[i] = BlockStatus.MISSING
                    continue
                off = 0
                for a, n in zip(t.addrs[i], self.layout.piece_sizes):
                    ctypes.memmove(int(a), blob[off : off + n], n)
                    off += n
                t.status[i] = BlockStatus.OK
            t.done.set()
