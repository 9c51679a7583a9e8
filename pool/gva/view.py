"""``View``: one process's immutable picture of the pool, swapped atomically on change.

A view joins a :class:`SegmentTable` with what *this* process can address directly:
its own windows and the windows of same-node ranks it mapped through
``Platform.import_handle`` (:class:`MappedWindow`). Copy planning reads one view from
start to end, so a concurrent membership change never mixes two tables in one copy.

``MappedWindow`` counts the copies in flight that use it (``pin``/``unpin``); a window
whose rank left is retired, then unmapped once its grace time has passed and no copy
pins it. Spans returned by ``Fabric.resolve`` are not pinned: they stay valid for
``GvaConfig.unmap_grace`` seconds after the rank leaves.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from kvfabric.errors import RankUnavailable
from kvfabric.platform.buffer import Buffer
from kvfabric.platform.types import Medium
from kvfabric.pool.gva.address import LOCAL_KEY, MEDIUM_REGION, key_rank, key_region
from kvfabric.pool.gva.segments import Segment, SegmentTable


class MappedWindow:
    """Another rank's window mapped into this process (owned by the fabric)."""

    __slots__ = ("buffer", "lock", "pins", "retired_at", "segment")

    def __init__(self, segment: Segment, buffer: Buffer) -> None:
        self.segment = segment
        self.buffer = buffer
        self.lock = threading.Lock()
        self.pins = 0
        self.retired_at: float | None = None

    def pin(self) -> None:
        with self.lock:
            if self.buffer.freed:
                raise RankUnavailable(
                    f"rank {self.segment.rank}'s {self.segment.medium.value} window is unmapped"
                )
            self.pins += 1

    def unpin(self) -> None:
        with self.lock:
            self.pins -= 1


@dataclass(frozen=True)
class Endpoint:
    """One window as this process sees it: ``ptr`` is 0 when it is not addressable here."""

    segment: Segment
    ptr: int
    buffer: Buffer | None
    mapped: MappedWindow | None  # None for this rank's own window or an unmapped one


class View:
    """The table plus local addressability (see module docstring)."""

    __slots__ = ("cols", "ends", "fast", "rank", "table")

    def __init__(self, table: SegmentTable, rank: int, ends: dict[int, Endpoint]) -> None:
        self.table = table
        self.rank = rank
        self.ends = ends
        # fast[region] = (stride, [(ptr, size, buffer) or None per rank]) for resolve()
        fast: list[tuple[int, list[tuple[int, int, Buffer] | None]]] = [(1, [])]
        for medium in (Medium.DRAM, Medium.HBM):
            region = MEDIUM_REGION[medium]
            stride = table.space.stride(medium) or 1
            slots: list[tuple[int, int, Buffer] | None] = []
            for key, e in ends.items():
                if key_region(key) == region and e.ptr and e.buffer is not None:
                    r = e.segment.rank
                    slots.extend([None] * (r + 1 - len(slots)))
                    slots[r] = (e.ptr, e.segment.nbytes, e.buffer)
            fast.append((stride, slots))
        self.fast = tuple(fast)
        # cols[region] = (sizes, since, ptrs) arrays indexed by rank, for vectorised batches
        cols: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = [
            (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.uint64))
        ]
        for region in (1, 2):
            sizes, since = table.columns(region)
            ptrs = np.zeros(sizes.size, np.uint64)
            for key, e in ends.items():
                if key_region(key) == region and e.ptr:
                    ptrs[e.segment.rank] = e.ptr
            cols.append((sizes, since, ptrs))
        self.cols = tuple(cols)

    def endpoint(self, key: int) -> Endpoint | None:
        return self.ends.get(key)

    def rank_of(self, key: int) -> int:
        """The rank a group key belongs to (plain local memory counts as this rank)."""
        return self.rank if key == LOCAL_KEY else key_rank(key)

    def addressable(self, key: int) -> bool:
        """True when the key's memory can be read and written by plain copies here."""
        if key == LOCAL_KEY:
            return True
        e = self.ends.get(key)
        return e is not None and e.ptr != 0

    def local_ptrs(self, key: int, raw: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """Local addresses of one side of a group: raw local addresses, or mapped base + offset."""
        if key == LOCAL_KEY:
            return raw
        e = self.ends[key]
        return offsets + np.uint64(e.ptr)
