"""``MappedDataPlane``: the same-node data path — every window mapped into this process.

The meta service's window registry gives each rank's export handle; this class maps them
(``Platform.import_handle``), keeps this process's own window as is, and turns GVAs into
local addresses with a vectorised lookup. Copies between caller buffers and windows go
through the platform (``batch_copy``); only the single-piece read fast path
(``reads.py``) copies host-addressable memory with a plain memmove.

Thread-safe for lookups and copies; mapping changes take a lock and publish a new
immutable snapshot.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

import numpy as np

from kvfabric.errors import RankUnavailable
from kvfabric.platform.base import Platform
from kvfabric.platform.buffer import Buffer
from kvfabric.platform.types import CopyBatch, Medium
from kvfabric.pool.windows import Addressing


@dataclass(frozen=True)
class _Map:
    lo: np.ndarray  # uint64 gva of each window's offset 0, sorted
    hi: np.ndarray
    base: np.ndarray  # uint64 local address of offset 0
    host: np.ndarray  # bool: host-addressable
    ranks: tuple[int, ...]
    lo_list: list[int]  # the same columns as Python ints, for scalar lookups
    hi_list: list[int]
    base_list: list[int]
    host_list: list[bool]


class MappedDataPlane:
    """See module docstring."""

    def __init__(self, platform: Platform, addressing: Addressing) -> None:
        self.platform = platform
        self.addr = addressing
        self._lock = threading.Lock()
        self._bufs: dict[tuple[int, Medium], tuple[Buffer, bool]] = {}  # -> (buffer, owned here)
        self._map = _Map(*(np.zeros(0, np.uint64) for _ in range(3)), np.zeros(0, bool), (), [], [], [], [])
        self._user_hit: tuple[Buffer, int, int, bool] | None = None

    # ------------------------------------------------------------------ mapping
    def add_local(self, rank: int, medium: Medium, buf: Buffer) -> None:
        """This process's own window (kept, never freed here)."""
        with self._lock:
            self._bufs[(rank, medium)] = (buf, False)
            self._rebuild()

    def map(self, rank: int, medium: Medium, handle: bytes) -> None:
        """Map another rank's window from its export handle (idempotent)."""
        with self._lock:
            if (rank, medium) in self._bufs:
                return
            buf = self.platform.import_handle(handle)
            if self.platform.host_addressable(buf.medium):
                buf.numpy()[::4096].max()  # map every page now (cheap: the owner touched them)
            self._bufs[(rank, medium)] = (buf, True)
            self._rebuild()

    def unmap(self, rank: int) -> None:
        with self._lock:
            for key in [k for k in self._bufs if k[0] == rank]:
                buf, owned = self._bufs.pop(key)
                if owned:
                    self.platform.free(buf)
            self._rebuild()

    def ranks(self) -> set[int]:
        return {r for r, _ in self._bufs}

    def _rebuild(self) -> None:
        items = sorted(
            ((self.addr.encode(m, r, 0), r, m, b) for (r, m), (b, _) in self._bufs.items()),
            key=lambda t: t[0],
        )
        hv = self.platform.host_addressable
        lo = [t[0] for t in items]
        hi = [t[0] + t[3].nbytes for t in items]
        base = [t[3].ptr for t in items]
        host = [hv(t[3].medium) for t in items]
        self._map = _Map(
            np.array(lo, np.uint64),
            np.array(hi, np.uint64),
            np.array(base, np.uint64),
            np.array(host, bool),
            tuple(t[1] for t in items),
            lo,
            hi,
            base,
            host,
        )

    # ------------------------------------------------------------------ addresses
    def resolve(self, gva: int, n: int) -> tuple[int, bool]:
        """``(local address, host-addressable)`` of ``[gva, gva + n)``."""
        m = self._map
        i = bisect.bisect_right(m.lo_list, gva) - 1
        if i < 0 or gva + n > m.hi_list[i]:
            medium, rank, off = self.addr.decode(gva)
            raise RankUnavailable(
                f"no mapped {medium.value} window of rank {rank} holds {n} B at offset {off} (gva {gva:#x})"
            )
        return m.base_list[i] + gva - m.lo_list[i], m.host_list[i]

    def resolve_many(self, gvas: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Vectorised :meth:`resolve`: ``(local addresses, host-addressable flags)``."""
        m = self._map
        g = gvas.astype(np.uint64, copy=False)
        i = np.searchsorted(m.lo, g, side="right").astype(np.int64) - 1
        bad = (i < 0) | ((g + sizes.astype(np.uint64)) > m.hi[np.maximum(i, 0)] if m.hi.size else True)
        if np.any(bad):
            k = int(np.flatnonzero(bad)[0])
            self.resolve(int(g[k]), int(sizes[k]))  # raises with the details
        return m.base[i] + (g - m.lo[i]), m.host[i]

    # ------------------------------------------------------------------ copies
    def copy(self, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, host: bool) -> None:
        """Copy pieces between checked local addresses with one platform batched copy (so
        device memory, the sim's cost ledger and its fault injection all apply). ``host``
        is kept for callers that special-case host memory themselves."""
        if dst.size:
            self.platform.batch_copy(CopyBatch(dst, src, sizes))

    def check_user(self, ptrs: np.ndarray, sizes: np.ndarray) -> bool:
        """Check caller ranges lie in platform buffers; True when all are host-addressable."""
        host = True
        for p, n in zip(ptrs.tolist(), sizes.tolist()):
            host = self.check_user_one(p, n) and host
        return host

    def check_user_one(self, ptr: int, n: int) -> bool:
        """One caller range (the last buffer found is remembered: callers reuse buffers)."""
        last = self._user_hit
        if last is not None and last[1] <= ptr and ptr + n <= last[2] and not last[0].freed:
            return last[3]
        span = self.platform.find(ptr, n)
        buf = span.buffer
        host = self.platform.host_addressable(buf.medium)
        self._user_hit = (buf, buf.ptr, buf.end, host)
        return host

    def close(self) -> None:
        with self._lock:
            for buf, owned in self._bufs.values():
                if owned and not buf.freed:
                    self.platform.free(buf)
            self._bufs.clear()
            self._rebuild()
