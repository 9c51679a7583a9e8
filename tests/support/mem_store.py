"""A small stateful in-memory Store for tests of the layers above the store contract.

It keeps the bytes of each (block id, shard) in a dict, moves them with ctypes from and
to the caller's addresses on a background thread (so tasks really are asynchronous and
``after`` events really are waited for), counts the pieces it copied, and can be told
to fail loads (``fail_loads``: all of them; ``fail_next_loads``: the next N blocks), to
report the next N loaded blocks ``CORRUPT`` (``corrupt_next_loads``: their destination gets
the bytes with one byte flipped, as a store whose check overlaps the copy may leave it) or
to stop answering (``down``), as a backing service would. Given a platform, it checks the
caller's addresses against the platform's live buffers before queueing anything.
"""

from __future__ import annotations

import ctypes
import threading
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from kvfabric.errors import ServiceUnavailable
from kvfabric.status import ItemStatus
from kvfabric.ucm_layer.store import base
from kvfabric.ucm_layer.store.base import Store, StoreLayout, Task, TaskKind


class MemTask(Task):
    """A task of a :class:`MemStore`: a future of the status array (``Task`` gives it the
    handle methods, ``wait_finished`` waiting on the future)."""

    def __init__(self, store: MemStore, kind: TaskKind, n: int, fut: Future) -> None:
        self.store, self.kind, self.num_blocks, self.fut, self.waited = store, kind, n, fut, False

    def wait_finished(self, timeout: float | None) -> bool:
        try:
            self.fut.exception(timeout)
        except TimeoutError:
            return False
        except CancelledError:
            pass
        return True


class MemStore(Store):
    name = "mem"

    def __init__(self, layout: StoreLayout, platform: Any = None) -> None:
        self.layout = layout
        self.platform = platform
        self.data: dict[tuple[bytes, int], bytes] = {}
        self.pieces_copied = 0
        self.fail_loads = False
        self.fail_next_loads = 0
        self.corrupt_next_loads = 0
        self.down = False
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="memstore")

    def _present(self, key: bytes) -> bool:
        return all((key, s) in self.data for s in range(self.layout.num_shards))

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        ids = base.check_ids(ids)
        if self.down:
            raise ServiceUnavailable("mem store is down")
        with self._lock:
            return np.array([self._present(i.tobytes()) for i in ids], bool)

    def _dump(self, ids: np.ndarray, shard: int, addrs: np.ndarray, after: Any) -> np.ndarray:
        if after is not None:
            after.synchronize()
        out = np.full(len(ids), ItemStatus.OK, np.int8)
        sizes = self.layout.piece_sizes
        for i, key in enumerate(ids):
            blob = b"".join(ctypes.string_at(int(a), n) for a, n in zip(addrs[i], sizes))
            with self._lock:
                self.data.setdefault((key.tobytes(), shard), blob)
                self.pieces_copied += len(sizes)
        return out

    def _load(self, ids: np.ndarray, shard: int, addrs: np.ndarray) -> np.ndarray:
        out = np.full(len(ids), ItemStatus.OK, np.int8)
        sizes = self.layout.piece_sizes
        for i, key in enumerate(ids):
            with self._lock:
                blob = self.data.get((key.tobytes(), shard))
            with self._lock:
                fail = self.fail_loads or self.down or self.fail_next_loads > 0
                self.fail_next_loads = max(0, self.fail_next_loads - 1)
            if fail:
                out[i] = ItemStatus.FAILED
                continue
            if blob is None:
                out[i] = ItemStatus.MISSING
                continue
            with self._lock:
                corrupt = self.corrupt_next_loads > 0
                self.corrupt_next_loads = max(0, self.corrupt_next_loads - 1)
            if corrupt:
                blob = bytes([blob[0] ^ 0xFF]) + blob[1:]
                out[i] = ItemStatus.CORRUPT
            off = 0
            for a, n in zip(addrs[i], sizes):
                ctypes.memmove(int(a), blob[off : off + n], n)
                off += n
            with self._lock:
                self.pieces_copied += len(sizes)
        return out

    def _checked(self, ids: Any, shard_idx: int, addrs: Any) -> tuple[np.ndarray, int, np.ndarray]:
        ids = base.check_ids(ids)
        shard = base.check_shard(shard_idx, self.layout)
        addrs = base.check_addrs(addrs, len(ids), self.layout)
        if self.platform is not None and addrs.size:
            base.check_ranges(self.platform, addrs, self.layout)
        return ids, shard, addrs

    def load(self, ids: np.ndarray, shard_idx: int, addrs: np.ndarray) -> Task:
        ids, shard, addrs = self._checked(ids, shard_idx, addrs)
        return MemTask(self, TaskKind.LOAD, len(ids), self._pool.submit(self._load, ids, shard, addrs))

    def dump(self, ids: np.ndarray, shard_idx: int, addrs: np.ndarray, after: Any = None) -> Task:
        ids, shard, addrs = self._checked(ids, shard_idx, addrs)
        return MemTask(self, TaskKind.DUMP, len(ids), self._pool.submit(self._dump, ids, shard, addrs, after))

    def check(self, task: Task) -> bool:
        return task.fut.done()  # type: ignore[attr-defined]

    def wait(self, task: Task, timeout: float | None = None) -> np.ndarray:
        if task.waited:  # type: ignore[attr-defined]
            raise ValueError("task already waited")
        task.waited = True  # type: ignore[attr-defined]
        if task.fut.cancelled():  # type: ignore[attr-defined]
            return np.full(task.num_blocks, ItemStatus.CANCELLED, np.int8)
        return task.fut.result(timeout)  # type: ignore[attr-defined]

    def cancel(self, task: Task) -> None:
        task.fut.cancel()  # type: ignore[attr-defined]

    def close(self) -> None:
        self._pool.shutdown(wait=True)
