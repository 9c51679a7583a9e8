"""``LruByBytes`` (pool/service/eviction.py) on an ``ExtentAllocator``: the stop rule
between the watermarks, the victim order and the directory-full pick."""

from __future__ import annotations

import numpy as np
import pytest

from kvfabric.pool.service.allocator import ExtentAllocator
from kvfabric.pool.service.eviction import LruByBytes


def test_evicts_oldest_first_down_to_the_low_watermark():
    """Ten 100-byte objects fill a 1,000-byte window (align 100); stamps make object 3 the
    oldest, then 0, 1, 2, 4, ... With low = 0.5 a trim must free five objects (used 1,000
    -> 500), in the order 3, 0, 1, 2, 4."""
    space = ExtentAllocator(1000, align=4)
    offs = [space.alloc(100) for _ in range(10)]
    stamps = np.array([1, 1, 1, 0, 2, 2, 2, 2, 2, 2])
    pol = LruByBytes(0.9, 0.5)
    assert pol.over_high(space.used, 1000)
    freed: list[int] = []

    def free(i: int) -> bool:
        space.free(offs[i], 100)
        freed.append(i)
        return True

    fits, n = pol.evict(space, 1000, 1, pol.order(stamps).tolist(), free)
    assert fits and n == 5 and freed == [3, 0, 1, 2, 4]
    assert space.used == 500 and not pol.over_high(space.used, 1000)
    assert pol.oldest(stamps) == 3


def test_gone_victims_do_not_count_and_running_out_is_reported():
    space = ExtentAllocator(1000, align=4)
    off = space.alloc(1000)
    pol = LruByBytes(0.9, 0.8)
    fits, n = pol.evict(space, 1000, 10, [0, 1], lambda i: False)
    assert (fits, n) == (False, 0)
    fits, n = pol.evict(space, 1000, 10, [0], lambda i: space.free(off, 1000) is None)
    assert (fits, n) == (True, 1)


@pytest.mark.parametrize("high,low", [(0.8, 0.8), (0.9, 0.0), (1.1, 0.5)])
def test_bad_watermarks(high, low):
    with pytest.raises(ValueError, match="watermarks"):
        LruByBytes(high, low)
