"""Pipelines beyond the contract: misses flow down, hits never do, de-duplicated fills,
write-through and write-behind, bypass when the cache is full, prefetch."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from store_faults import FullDiskIO, StallingIO, plant_flip
from stores import LAYOUT, Blocks, block_bytes, build_store, dump_blocks, load_checked, random_ids

from kvfabric.platform.sim import SimPlatform
from kvfabric.ucm_layer.store.base import BlockStatus

OK, MISSING = int(BlockStatus.OK), int(BlockStatus.MISSING)
N = 12


@pytest.fixture
def plat():
    p = SimPlatform()
    yield p
    p.close()


def wait_until(cond, what, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_misses_flow_down_hits_never_do(tmp_path, plat):
    ids = random_ids(N, 1)
    with build_store("posix", tmp_path, plat) as lower_only:
        assert (dump_blocks(lower_only, plat, ids) == OK).all()
    p = build_store("cache|posix", tmp_path, plat)  # cold cache over a warm posix store
    assert p.lookup(ids).all() and not p.upper.lookup(ids).any()
    assert (load_checked(p, plat, ids[:8]) == OK).all()
    s = p.stats()
    assert s["posix.load_ok"] == 8 and s["cache.slots_ready"] == 8
    assert (load_checked(p, plat, ids) == OK).all()  # 8 hits, 4 misses go down
    assert p.stats()["posix.load_ok"] == 12
    assert (load_checked(p, plat, ids) == OK).all()
    assert p.stats()["posix.load_ok"] == 12
    p.close()


def test_concurrent_loads_fill_each_block_once(tmp_path, plat):
    ids = random_ids(N, 2)
    with build_store("posix", tmp_path, plat) as lower_only:
        assert (dump_blocks(lower_only, plat, ids) == OK).all()
    p = build_store("cache|posix", tmp_path, plat, **{"pipeline.workers": 4})
    results = [None] * 4
    barrier = threading.Barrier(4)

    def run(k):
        barrier.wait()
        results[k] = load_checked(p, plat, ids)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(r is not None and (r == OK).all() for r in results)
    assert p.stats()["posix.load_ok"] == N  # one fill per block, the other loads waited for it
    p.close()


def test_lookup_prefix_combines_the_tiers(tmp_path, plat):
    ids = random_ids(6, 3)
    with build_store("posix", tmp_path, plat) as lower_only:
        assert (dump_blocks(lower_only, plat, ids[[0, 2, 3]]) == OK).all()
    p = build_store("cache|posix", tmp_path, plat)
    assert (dump_blocks(p.upper, plat, ids[[1, 4]]) == OK).all()  # in the cache only
    assert p.lookup(ids).tolist() == [True, True, True, True, True, False]
    assert p.lookup_prefix(ids) == 5
    assert p.lookup_prefix(ids[1:]) == 4
    p.close()


def test_write_behind_is_visible_only_once_the_lowest_tier_has_it(tmp_path, plat):
    p = build_store("cache|posix", tmp_path, plat, **{"pipeline.write": "behind"})
    stall = StallingIO(str(tmp_path / "stalled"))
    p.lower.io = stall
    ids = random_ids(4, 4)
    st = dump_blocks(p, plat, ids)  # returns while the lower store is stuck: buffers are free
    assert (st == OK).all()
    wait_until(lambda: (tmp_path / "stalled").exists(), "the lower write never started")
    assert not p.lookup(ids).any()
    stall.release.set()
    wait_until(lambda: p.lookup(ids).all(), "blocks written behind never became visible")
    assert (load_checked(p, plat, ids) == OK).all()
    p.close()


def test_write_through_waits_for_the_lowest_tier(tmp_path, plat):
    p = build_store("cache|posix", tmp_path, plat)
    stall = StallingIO(str(tmp_path / "stalled"))
    p.lower.io = stall
    ids = random_ids(4, 5)
    b = Blocks(plat, LAYOUT, 4)
    b.write(block_bytes(ids, LAYOUT.shard_bytes))
    t = p.dump(ids, 0, b.addrs)
    wait_until(lambda: (tmp_path / "stalled").exists(), "the lower write never started")
    assert not p.check(t) and not p.lookup(ids).any()
    stall.release.set()
    assert (p.wait(t) == OK).all() and p.lookup(ids).all()
    p.close()


def test_write_behind_failures_are_counted_and_stay_invisible(tmp_path, plat):
    p = build_store("cache|posix", tmp_path, plat, **{"pipeline.write": "behind", "posix.io_threads": 1})
    p.lower.io = FullDiskIO(budget=2 * p.lower.file_bytes)  # two block files, trailers included
    ids = random_ids(5, 6)
    assert (dump_blocks(p, plat, ids) == OK).all()
    wait_until(lambda: p.stats()["behind_failed"] == 3, "write-behind failures were not counted")
    assert p.lookup(ids).sum() == 2
    assert p.stats()["cache.slots_filling"] == 0
    p.close()


def test_a_full_cache_is_bypassed(tmp_path, plat):
    p = build_store("cache|posix", tmp_path, plat, **{"cache.capacity": 2 * (LAYOUT.shard_bytes + 64)})
    ids = random_ids(N, 7)
    assert (dump_blocks(p, plat, ids) == OK).all()
    assert p.lower.lookup(ids).all()
    assert (load_checked(p, plat, ids) == OK).all()
    p.close()


def test_without_promotion_loads_leave_the_cache_alone(tmp_path, plat):
    ids = random_ids(N, 8)
    with build_store("posix", tmp_path, plat) as lower_only:
        assert (dump_blocks(lower_only, plat, ids) == OK).all()
    p = build_store("cache|posix", tmp_path, plat, **{"pipeline.promote": False})
    assert (load_checked(p, plat, ids) == OK).all()
    assert p.stats()["cache.slots_ready"] == 0
    p.close()


def test_prefetch_fills_the_cache(tmp_path, plat):
    ids = random_ids(N, 9)
    with build_store("posix", tmp_path, plat) as lower_only:
        assert (dump_blocks(lower_only, plat, ids) == OK).all()
    p = build_store("cache|posix", tmp_path, plat)
    p.prefetch(ids)
    wait_until(lambda: p.upper.lookup(ids).all(), "prefetch did not fill the cache")
    loads = p.stats()["posix.load_ok"]
    assert (load_checked(p, plat, ids) == OK).all()
    assert p.stats()["posix.load_ok"] == loads
    missing = random_ids(3, 10)
    p.prefetch(missing)
    assert (load_checked(p, plat, missing) == MISSING).all()
    p.close()


def test_a_load_waiting_on_blocks_written_behind_cannot_starve_them(tmp_path, plat):
    """One pipeline worker, busy with a load that waits for slots still being written
    behind: the writes settle on the lower store's threads, so the load completes."""
    p = build_store("cache|posix", tmp_path, plat, **{"pipeline.write": "behind", "pipeline.workers": 1})
    stall = StallingIO(str(tmp_path / "stalled"))
    p.lower.io = stall
    ids = random_ids(4, 11)
    assert (dump_blocks(p, plat, ids) == OK).all()
    b = Blocks(plat, LAYOUT, 4)
    t = p.load(ids, 0, b.addrs)
    wait_until(lambda: (tmp_path / "stalled").exists(), "the lower write never started")
    assert not p.check(t)
    stall.release.set()
    assert (p.wait(t, timeout=30) == OK).all()
    assert np.array_equal(b.read(), block_bytes(ids, LAYOUT.shard_bytes))
    p.close()


def test_a_block_that_fails_verification_below_is_not_promoted(tmp_path, plat):
    p = build_store("cache|posix", tmp_path, plat)
    ids = random_ids(4, 41)
    assert (dump_blocks(p.lower, plat, ids) == OK).all()  # only in the posix tier
    plant_flip(p.lower, ids[1])
    st = load_checked(p, plat, ids)
    assert st.tolist() == [OK, int(BlockStatus.CORRUPT), OK, OK]
    stats = p.stats()
    assert stats["cache.slots_ready"] == 3 and stats["cache.slots_filling"] == 0
    assert p.upper.lookup(ids).tolist() == [True, False, True, True]  # promoted: the good ones only
    ready = np.flatnonzero(p.upper.table.state == 2)
    # sealed with the digests posix computed while verifying, which are the slots' bytes' digests
    assert np.array_equal(p.upper.table.digest[ready], p.upper.digests(ready))
    assert stats["corrupt_blocks"] == 1 and stats["posix.corrupt_blocks"] == 1
    assert stats["load_corrupt"] == 1
    p.close()
