"""Host copies for the sim platform: large ones are split across a few threads.

A device moves bytes on copy engines while its host does other work; on host memory the
nearest thing is a second core, and one core alone does not saturate memory bandwidth (on
a 2-core development machine, 7 GB/s with one thread, 13 GB/s with two). A copy whose bytes
reach ``parallel_bytes`` is cut into ``threads`` parts of about equal bytes (a piece may be
cut in two) that run at once: one on the calling thread, the rest on a small pool shared by
the process. Smaller copies, and a single piece whose source and destination overlap, stay
one call on the calling thread.

Contract: ``copy_batch`` / ``copy_one`` return when every byte was copied, and raise only if
a part raised (after every part has ended, so no part still writes when the caller sees the
error). The pieces of one batch must not overlap each other (the platform contract says so
already); the order in which the bytes land is unspecified. Thread-safe.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from kvfabric.envs import KVFABRIC_COPY_THREADS
from kvfabric.platform.native import CtypesNative, Native

PARALLEL_BYTES = 4 << 20
MAX_AUTO_THREADS = 4

_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_lock = threading.Lock()


def default_threads() -> int:
    """``KVFABRIC_COPY_THREADS``, else the cores this process may run on (at most 4)."""
    n = KVFABRIC_COPY_THREADS.get()
    if n is not None:
        return n
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(MAX_AUTO_THREADS, cores))


def _executor(workers: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size < workers:
            # an outgrown pool finishes what it holds and its threads exit
            old, _pool = _pool, ThreadPoolExecutor(workers, thread_name_prefix="kvfabric-copy")
            _pool_size = workers
            if old is not None:
                old.shutdown(wait=False)
        return _pool


def split(
    dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray, parts: int
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Cut a batch (uint64 arrays) into ``parts`` batches of about equal bytes, in order."""
    ends = np.cumsum(nbytes, dtype=np.uint64)
    starts = ends - nbytes
    total = int(ends[-1]) if ends.size else 0
    cuts = [total * k // parts for k in range(parts + 1)]
    out = []
    for b0, b1 in itertools.pairwise(cuts):
        if b1 <= b0:
            continue
        i0 = int(np.searchsorted(ends, b0, side="right"))  # first piece ending after b0
        i1 = int(np.searchsorted(starts, b1, side="left"))  # pieces starting before b1
        st, en = starts[i0:i1], ends[i0:i1]
        lo = np.maximum(st, np.uint64(b0))
        hi = np.minimum(en, np.uint64(b1))
        off = lo - st
        keep = hi > lo
        out.append(((dst[i0:i1] + off)[keep], (src[i0:i1] + off)[keep], (hi - lo)[keep]))
    return out


class HostCopier:
    """Copies between host addresses for one platform (see module docstring)."""

    def __init__(
        self, native: Native | CtypesNative, threads: int | None = None, parallel_bytes: int = PARALLEL_BYTES
    ) -> None:
        threads = default_threads() if threads is None else threads
        if threads < 1:
            raise ValueError(f"copy threads must be >= 1, got {threads}")
        if parallel_bytes < 1:
            raise ValueError(f"parallel_bytes must be >= 1, got {parallel_bytes}")
        self.native, self.threads, self.parallel_bytes = native, threads, parallel_bytes

    def copy_batch(self, dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray, total: int) -> None:
        if self.threads == 1 or total < self.parallel_bytes:
            self.native.memcpy_batch(dst, src, nbytes)
            return
        d, s, n = (np.ascontiguousarray(a, np.uint64) for a in (dst, src, nbytes))
        parts = min(self.threads, max(1, total // (self.parallel_bytes // 2)))
        self._run(split(d, s, n, parts))

    def copy_one(self, dst: int, src: int, nbytes: int) -> None:
        overlap = abs(dst - src) < nbytes
        if self.threads == 1 or nbytes < self.parallel_bytes or overlap:
            ctypes.memmove(dst, src, nbytes)
            return
        one = np.array([nbytes], np.uint64)
        self.copy_batch(np.array([dst], np.uint64), np.array([src], np.uint64), one, nbytes)

    def _run(self, parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> None:
        if len(parts) == 1:
            self.native.memcpy_batch(*parts[0])
            return
        pool = _executor(self.threads - 1)
        futures: list[Future[None]] = [pool.submit(self.native.memcpy_batch, *p) for p in parts[1:]]
        error: BaseException | None = None
        try:
            self.native.memcpy_batch(*parts[0])
        except BaseException as e:  # noqa: BLE001 - re-raised once every part has ended
            error = e
        for f in futures:
            try:
                f.result()
            except BaseException as e:  # noqa: BLE001
                error = error or e
        if error is not None:
            raise error
