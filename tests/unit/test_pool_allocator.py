import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfabric.pool.service.allocator import ExtentAllocator


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5000)), max_size=200))
def test_extents_never_overlap_and_all_space_returns(ops):
    a = ExtentAllocator(64 * 1024, align=64)
    live: dict[int, int] = {}
    for alloc, n in ops:
        if alloc or not live:
            off = a.alloc(n)
            if off is None:
                assert a.largest_free < a.round(n)
                continue
            end = off + a.round(n)
            assert off >= 0 and end <= a.capacity and off % 64 == 0
            assert all(end <= o or o + a.round(s) <= off for o, s in live.items())
            live[off] = n
        else:
            off = sorted(live)[n % len(live)]
            a.free(off, live.pop(off))
        assert a.used == sum(a.round(s) for s in live.values())
    for off, n in list(live.items()):
        a.free(off, n)
    assert a.used == 0 and a.largest_free == a.capacity


def test_errors_and_reserve():
    a = ExtentAllocator(4096, align=256)
    with pytest.raises(ValueError, match="> 0"):
        a.alloc(0)
    off = a.alloc(300)
    a.free(off, 300)
    with pytest.raises(ValueError, match="double free"):
        a.free(off, 300)
    with pytest.raises(ValueError, match="not inside"):
        a.free(8192, 10)
    a.reserve(1024, 512)
    assert a.alloc(1024) == 0 and a.alloc(256) == 1536
    with pytest.raises(ValueError, match="not free"):
        a.reserve(1024, 10)
    with pytest.raises(ValueError, match="power of two"):
        ExtentAllocator(4096, align=100)
