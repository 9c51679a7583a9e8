"""``ExtentAllocator``: space inside one window, as (offset, size) extents.

Best fit over a free list kept sorted by offset (for coalescing) with a size index (for
the fit), both plain sorted lists: O(log n) searches and O(n) memmove inserts over the
number of *free extents* (not objects), which stays small because neighbours coalesce.
Sizes are rounded up to ``align`` bytes (default 256: cache-line and DMA friendly).

Not thread-safe: the meta service calls it from its single loop thread.
"""

from __future__ import annotations

import bisect


class ExtentAllocator:
    """Free space of a window of ``capacity`` bytes (see module docstring)."""

    def __init__(self, capacity: int, align: int = 256) -> None:
        if capacity <= 0:
            raise ValueError(f"window capacity must be > 0, got {capacity}")
        if align <= 0 or align & (align - 1):
            raise ValueError(f"align must be a power of two, got {align}")
        self.capacity = capacity - capacity % align
        self.align = align
        self._offs: list[int] = [0]  # free extents sorted by offset
        self._sizes: dict[int, int] = {0: self.capacity}
        self._by_size: list[tuple[int, int]] = [(self.capacity, 0)]  # (size, offset) sorted
        self.used = 0

    def round(self, nbytes: int) -> int:
        return -(-nbytes // self.align) * self.align

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used

    @property
    def largest_free(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a new extent of ``nbytes`` (rounded up), or None if nothing fits."""
        if nbytes <= 0:
            raise ValueError(f"allocation size must be > 0, got {nbytes}")
        need = self.round(nbytes)
        k = bisect.bisect_left(self._by_size, (need, -1))
        if k == len(self._by_size):
            return None
        size, off = self._by_size.pop(k)
        del self._sizes[off]
        i = bisect.bisect_left(self._offs, off)
        del self._offs[i]
        if size > need:
            self._add_free(off + need, size - need)
        self.used += need
        return off

    def free(self, offset: int, nbytes: int) -> None:
        """Return the extent at ``offset`` (its original size); neighbours coalesce."""
        size = self.round(nbytes)
        if offset < 0 or offset + size > self.capacity or offset % self.align:
            raise ValueError(f"extent {offset}+{size} is not inside this {self.capacity} B window")
        i = bisect.bisect_left(self._offs, offset)
        if i < len(self._offs) and self._offs[i] < offset + size:
            raise ValueError(f"double free: extent {offset}+{size} overlaps free space")
        if i > 0:
            prev = self._offs[i - 1]
            if prev + self._sizes[prev] > offset:
                raise ValueError(f"double free: extent {offset}+{size} overlaps free space")
        self.used -= size
        # coalesce with the following and the preceding free extents
        if i < len(self._offs) and self._offs[i] == offset + size:
            nxt = self._offs[i]
            size += self._pop_free(nxt, i)
        if i > 0:
            prev = self._offs[i - 1]
            if prev + self._sizes[prev] == offset:
                psize = self._pop_free(prev, i - 1)
                offset, size = prev, size + psize
        self._add_free(offset, size)

    def _pop_free(self, off: int, idx: int) -> int:
        size = self._sizes.pop(off)
        del self._offs[idx]
        k = bisect.bisect_left(self._by_size, (size, off))
        del self._by_size[k]
        return size

    def _add_free(self, off: int, size: int) -> None:
        bisect.insort(self._offs, off)
        self._sizes[off] = size
        bisect.insort(self._by_size, (size, off))

    def reserve(self, offset: int, nbytes: int) -> None:
        """Mark ``[offset, offset + nbytes)`` used (rebuilding after a restart)."""
        size = self.round(nbytes)
        i = bisect.bisect_right(self._offs, offset) - 1
        if i < 0:
            raise ValueError(f"extent {offset}+{size} is not free")
        start = self._offs[i]
        fsize = self._sizes[start]
        if offset + size > start + fsize:
            raise ValueError(f"extent {offset}+{size} is not free")
        self._pop_free(start, i)
        if offset > start:
            self._add_free(start, offset - start)
        if start + fsize > offset + size:
            self._add_free(offset + size, start + fsize - offset - size)
        self.used += size
