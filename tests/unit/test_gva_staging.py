"""The remote transport's staging buffers: size classes, reuse, the kept cap, close."""

from __future__ import annotations

import pytest

from kvfabric.platform.buffer import Buffer
from kvfabric.platform.registry import create
from kvfabric.platform.types import Medium
from kvfabric.pool.gva.transports.staging import MIN_BYTES, StagingPool, size_class


@pytest.fixture
def plat():
    p = create("sim")
    yield p
    p.close()


def test_size_classes():
    assert size_class(1) == MIN_BYTES
    assert size_class(MIN_BYTES) == MIN_BYTES
    assert size_class(MIN_BYTES + 1) == 2 * MIN_BYTES
    assert size_class(3 << 20) == 4 << 20


def test_buffers_are_registered_once_reused_and_released_past_the_cap(plat):
    registered: list[Buffer] = []
    forgotten: list[Buffer] = []
    pool = StagingPool(plat, registered.append, forgotten.append, keep_bytes=2 * MIN_BYTES)
    a = pool.take(Medium.DRAM, 1000)
    assert a.nbytes == MIN_BYTES and a.medium is Medium.DRAM and registered == [a]
    pool.give(a)
    b = pool.take(Medium.DRAM, MIN_BYTES)
    assert b is a and registered == [a]  # reused, not registered again
    c = pool.take(Medium.DRAM, MIN_BYTES)  # a second one while the first is out
    d = pool.take(Medium.DRAM, 3 * MIN_BYTES)  # 4 x MIN_BYTES: over the cap once given back
    assert c is not a and d.nbytes == 4 * MIN_BYTES and len(registered) == 3
    for buf in (b, c, d):
        pool.give(buf)
    assert forgotten == [d] and d.freed and not b.freed and not c.freed
    held = pool.take(Medium.DRAM, 10)  # the latest given back; still out at close: left alone
    assert held is c
    assert pool.close() == 1
    assert forgotten == [d, b] and b.freed and not held.freed


def test_a_failed_registration_frees_the_buffer(plat):
    def refuse(buf: Buffer) -> None:
        raise RuntimeError("engine refused")

    pool = StagingPool(plat, refuse, lambda buf: None)
    before = len(plat.buffers())
    with pytest.raises(RuntimeError, match="engine refused"):
        pool.take(Medium.DRAM, 100)
    assert len(plat.buffers()) == before
