"""``AddressMap``: which live buffer holds an address, for scalar and vectorised lookups.

Every buffer a platform hands out (allocated, imported, registered, wrapped) is entered
here, so a raw address in a batched copy can be checked against the memory it claims and
its medium (hence the copy direction) found without Python work per piece.

Thread-safe: mutations take a lock and bump a version; lookups read an immutable
snapshot of sorted numpy columns rebuilt lazily after a change.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

import numpy as np

from kvfabric.platform.buffer import Buffer
from kvfabric.platform.types import Medium

_MEDIUM_CODE = {Medium.DRAM: 0, Medium.HBM: 1}


@dataclass(frozen=True)
class _Snapshot:
    starts: np.ndarray  # uint64, sorted
    ends: np.ndarray  # uint64
    media: np.ndarray  # uint8 (0 = DRAM, 1 = HBM)
    buffers: tuple[Buffer, ...]
    start_list: list[int]
    end_list: list[int]
    media_list: list[int]


class AddressMap:
    """Sorted, non-overlapping address ranges of live buffers."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._buffers: list[Buffer] = []
        self._snapshot: _Snapshot | None = None

    def add(self, buf: Buffer) -> None:
        """Enter ``buf``; ``ValueError`` if it overlaps a live buffer."""
        with self._lock:
            i = bisect.bisect_right(self._starts, buf.ptr)
            if i > 0 and self._buffers[i - 1].end > buf.ptr:
                other = self._buffers[i - 1]
                raise ValueError(f"memory {buf.ptr:#x}+{buf.nbytes} overlaps {other!r}")
            if i < len(self._starts) and self._starts[i] < buf.end:
                raise ValueError(f"memory {buf.ptr:#x}+{buf.nbytes} overlaps {self._buffers[i]!r}")
            self._starts.insert(i, buf.ptr)
            self._buffers.insert(i, buf)
            self._snapshot = None

    def remove(self, buf: Buffer) -> None:
        with self._lock:
            i = bisect.bisect_left(self._starts, buf.ptr)
            if i < len(self._starts) and self._buffers[i] is buf:
                del self._starts[i]
                del self._buffers[i]
                self._snapshot = None

    def buffers(self) -> list[Buffer]:
        with self._lock:
            return list(self._buffers)

    def find(self, ptr: int, nbytes: int) -> tuple[Buffer, int]:
        """The buffer holding ``[ptr, ptr + nbytes)`` and the offset; ``ValueError`` if none."""
        with self._lock:
            i = bisect.bisect_right(self._starts, ptr) - 1
            if i >= 0:
                buf = self._buffers[i]
                if ptr + nbytes <= buf.end:
                    return buf, ptr - buf.ptr
        raise ValueError(
            f"address range {ptr:#x}+{nbytes} is not inside any live buffer of this platform "
            "(allocate it, import it, or register it first)"
        )

    def _snap(self) -> _Snapshot:
        snap = self._snapshot
        if snap is None:
            with self._lock:
                bufs = tuple(self._buffers)
                starts = [b.ptr for b in bufs]
                ends = [b.end for b in bufs]
                media = [_MEDIUM_CODE[b.medium] for b in bufs]
                snap = _Snapshot(
                    np.array(starts, np.uint64),
                    np.array(ends, np.uint64),
                    np.array(media, np.uint8),
                    bufs,
                    starts,
                    ends,
                    media,
                )
                self._snapshot = snap
        return snap

    def media_of(self, ptrs: np.ndarray, sizes: np.ndarray, what: str) -> np.ndarray:
        """Medium codes (0 DRAM, 1 HBM) of each range; ``ValueError`` naming the first stray."""
        snap = self._snap()
        if ptrs.size == 0:
            return np.zeros(0, np.uint8)
        if ptrs.size <= 4:  # a few pieces: scalar bisection beats numpy's per-call overhead
            out = np.empty(ptrs.size, np.uint8)
            for k, (p, n) in enumerate(zip(ptrs.tolist(), sizes.tolist())):
                i = bisect.bisect_right(snap.start_list, p) - 1
                if i < 0 or p + n > snap.end_list[i]:
                    raise ValueError(
                        f"batch item {k}: {what} range {p:#x}+{n} is not inside any live buffer "
                        "of this platform"
                    )
                out[k] = snap.media_list[i]
            return out
        idx = np.searchsorted(snap.starts, ptrs, side="right").astype(np.int64) - 1
        ok = idx >= 0
        safe = np.where(ok, idx, 0)
        if snap.ends.size:
            ok &= (ptrs + sizes) <= snap.ends[safe]
        else:
            ok[:] = False
        if not ok.all():
            bad = int(np.flatnonzero(~ok)[0])
            raise ValueError(
                f"batch item {bad}: {what} range {int(ptrs[bad]):#x}+{int(sizes[bad])} is not inside "
                "any live buffer of this platform"
            )
        return snap.media[safe]
