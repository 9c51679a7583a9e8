"""``LruByBytes``: the pool's eviction policy, apart from where the objects are recorded.

Contract (what :class:`~kvfabric.pool.service.meta.MetaService` does with it, and what
``kvfabric sim`` drives per simulated tier):

* A window of ``size`` bytes whose used bytes exceed ``high_watermark * size`` after an
  allocation is trimmed (:meth:`over_high`, then :meth:`evict` with ``need=1``).
* An allocation that finds no free extent evicts in that window (:meth:`evict` with the
  allocation's size).
* Victims go least recently used first (:meth:`order`: a stable sort of the recency
  stamps, so equal stamps keep the order the caller listed them in), and eviction stops
  as soon as the largest free extent holds ``need`` bytes (rounded as the space rounds)
  *and* used bytes are at most ``low_watermark * size`` (``int`` of it); it also stops
  when the victims run out. :meth:`evict` answers whether ``need`` fits afterwards.
* Which objects are candidates (readable, not under a read lease, in that window) is the
  caller's business: the policy sees recency stamps and calls ``free(victim)``, which
  frees the victim's space and answers whether it did (a victim gone in the meantime
  answers False and does not count).
* A full directory evicts one object, the least recently used of all candidates
  (:meth:`oldest`: the first one of the lowest stamp).

Pure: no I/O, no clock, no locks (its callers serialise their calls).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol, TypeVar

import numpy as np

V = TypeVar("V")


class Space(Protocol):
    """What the policy reads of a window's space (``ExtentAllocator`` is one)."""

    used: int

    @property
    def largest_free(self) -> int: ...

    def round(self, nbytes: int) -> int: ...


class LruByBytes:
    """LRU by bytes between two watermarks (see module docstring)."""

    __slots__ = ("high_watermark", "low_watermark")

    def __init__(self, high_watermark: float, low_watermark: float) -> None:
        if not 0 < low_watermark < high_watermark <= 1:
            raise ValueError(
                f"eviction watermarks: need 0 < low_watermark ({low_watermark}) < "
                f"high_watermark ({high_watermark}) <= 1"
            )
        self.high_watermark = float(high_watermark)
        self.low_watermark = float(low_watermark)

    def over_high(self, used: int, size: int) -> bool:
        """Whether a window of ``size`` bytes with ``used`` in use is to be trimmed."""
        return used > size * self.high_watermark

    def order(self, stamps: np.ndarray) -> np.ndarray:
        """Positions into ``stamps`` (recency, larger = more recent), oldest first, stable."""
        return np.argsort(stamps, kind="stable")

    def oldest(self, stamps: np.ndarray) -> int:
        """The position of the least recently used one (the first of equal stamps)."""
        return int(np.argmin(stamps))

    def evict(
        self, space: Space, size: int, need: int, victims: Iterable[V], free: Callable[[V], bool]
    ) -> tuple[bool, int]:
        """Free ``victims`` (oldest first) until ``need`` bytes fit and the window of
        ``size`` bytes is down to the low watermark: ``(need fits now, victims freed)``."""
        target = int(size * self.low_watermark)
        want = space.round(need)
        freed = 0
        for v in victims:
            if space.largest_free >= want and space.used <= target:
                break
            if free(v):
                freed += 1
        return space.largest_free >= want, freed


__all__ = ["LruByBytes", "Space"]
