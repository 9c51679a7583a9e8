"""The store conformance suite. Tier test files import * from here and provide the ``spec``
fixture (a platform spec understood by ``platforms.build``) and the ``store_spec`` fixture
(a store or pipeline spec from ``stores.STORE_SPECS``). Part 2 (failures) lives in
``store_contract_failures`` and comes with the star import."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from platforms import build
from store_contract_failures import *  # noqa: F403  (part 2 of the suite)
from store_faults import FLIP_AT, plant_flip
from stores import LAYOUT, Blocks, block_bytes, build_store, random_ids, stop_pool_daemons

from kvfabric.platform.types import Medium
from kvfabric.ucm_layer.store.base import BlockStatus, StoreLayout

OK, MISSING, FAILED = int(BlockStatus.OK), int(BlockStatus.MISSING), int(BlockStatus.FAILED)
CANCELLED, TIMEOUT = int(BlockStatus.CANCELLED), int(BlockStatus.TIMEOUT)
CORRUPT = int(BlockStatus.CORRUPT)
N = 16


@pytest.fixture
def plat(spec):
    p = build(spec)
    yield p
    stop_pool_daemons()
    p.close()


@pytest.fixture
def store(store_spec, tmp_path, plat):
    s = build_store(store_spec, tmp_path, plat)
    yield s
    s.close()
    stop_pool_daemons()


def dump_all(store, ids, blocks, after=None):
    return store.wait(store.dump(ids, 0, blocks.addrs, after=after))


def load_all(store, ids, blocks):
    return store.wait(store.load(ids, 0, blocks.addrs))


# ---------------------------------------------------------------------------- round trips
@pytest.mark.parametrize(
    "medium,contiguous", [(Medium.HBM, False), (Medium.DRAM, True), (Medium.DRAM, False)]
)
def test_round_trip_bit_exact(store, plat, medium, contiguous):
    ids = random_ids(N, 1)
    data = block_bytes(ids, LAYOUT.shard_bytes)
    src, dst = Blocks(plat, LAYOUT, N, medium, contiguous), Blocks(plat, LAYOUT, N, medium, contiguous)
    src.write(data)
    assert not store.lookup(ids).any() and store.lookup_prefix(ids) == 0
    assert (dump_all(store, ids, src) == OK).all()
    assert store.lookup(ids).all() and store.lookup_prefix(ids) == N
    assert (load_all(store, ids, dst) == OK).all()
    assert np.array_equal(dst.read(), data)
    dst.write(np.full_like(data, Blocks.SENTINEL))
    assert (dst.view() == Blocks.SENTINEL).all(), "a load wrote outside the pieces"


def test_partial_prefix_and_missing_blocks_untouched(store, plat):
    ids = random_ids(10, 2)
    data = block_bytes(ids, LAYOUT.shard_bytes)
    src = Blocks(plat, LAYOUT, 10)
    src.write(data)
    present = np.r_[0:5, 7:9]
    sub = Blocks(plat, LAYOUT, present.size)
    sub.write(data[present])
    assert (dump_all(store, ids[present], sub) == OK).all()
    want = np.zeros(10, bool)
    want[present] = True
    assert np.array_equal(store.lookup(ids), want)
    assert store.lookup_prefix(ids) == 5
    assert store.lookup_prefix(ids[5:]) == 0
    assert store.lookup_prefix(ids[7:9]) == 2
    dst = Blocks(plat, LAYOUT, 10)
    st = load_all(store, ids, dst)
    assert np.array_equal(st == OK, want) and (st[~want] == MISSING).all()
    got = dst.read()
    assert np.array_equal(got[present], data[present])
    assert all(dst.untouched(i) for i in np.flatnonzero(~want))


def test_empty_calls(store, plat):
    ids = np.zeros((0, 16), np.uint8)
    assert store.lookup(ids).shape == (0,) and store.lookup_prefix(ids) == 0
    for t in (
        store.load(ids, 0, np.zeros((0, LAYOUT.pieces), np.uint64)),
        store.dump(ids, 0, np.zeros((0, LAYOUT.pieces), np.uint64)),
    ):
        assert store.wait(t).shape == (0,)


def test_duplicate_ids_in_one_call(store, plat):
    ids = random_ids(3, 3)
    rows = ids[[0, 0, 1, 2, 1]]
    data = block_bytes(rows, LAYOUT.shard_bytes)
    src, dst = Blocks(plat, LAYOUT, 5), Blocks(plat, LAYOUT, 5)
    src.write(data)
    assert (dump_all(store, rows, src) == OK).all()
    assert store.lookup(ids).all()
    assert (load_all(store, rows, dst) == OK).all()
    assert np.array_equal(dst.read(), data)


def test_dump_is_put_if_absent(store, plat):
    ids = random_ids(4, 4)
    first, second = block_bytes(ids, LAYOUT.shard_bytes, 1), block_bytes(ids, LAYOUT.shard_bytes, 2)
    a, b, dst = Blocks(plat, LAYOUT, 4), Blocks(plat, LAYOUT, 4), Blocks(plat, LAYOUT, 4)
    a.write(first)
    b.write(second)
    assert (dump_all(store, ids, a) == OK).all()
    assert (dump_all(store, ids, b) == OK).all()
    assert (load_all(store, ids, dst) == OK).all()
    assert np.array_equal(dst.read(), first)


def test_two_shards_visible_only_when_complete(store_spec, tmp_path, plat):
    layout = StoreLayout((2048, 512), num_shards=2)
    s = build_store(store_spec, tmp_path, plat, layout)
    try:
        ids = random_ids(6, 5)
        d0, d1 = block_bytes(ids, layout.shard_bytes, 10), block_bytes(ids, layout.shard_bytes, 11)
        b0, b1 = Blocks(plat, layout, 6), Blocks(plat, layout, 6)
        b0.write(d0)
        b1.write(d1)
        assert (s.wait(s.dump(ids, 0, b0.addrs)) == OK).all()
        assert not s.lookup(ids).any()
        assert (s.wait(s.dump(ids[:4], 1, b1.addrs[:4])) == OK).all()
        assert np.array_equal(s.lookup(ids), [True] * 4 + [False] * 2)
        out0, out1 = Blocks(plat, layout, 4), Blocks(plat, layout, 4)
        assert (s.wait(s.load(ids[:4], 0, out0.addrs)) == OK).all()
        assert (s.wait(s.load(ids[:4], 1, out1.addrs)) == OK).all()
        assert np.array_equal(out0.read(), d0[:4]) and np.array_equal(out1.read(), d1[:4])
    finally:
        s.close()


# ---------------------------------------------------------------------------- integrity
def _dump_to(s, site, ids, plat):
    """Dump ``block_bytes(ids)``: through ``s``, or (``bottom`` of a pipeline) into its lower
    tier only, so the block is not in the cache."""
    target = s.lower if site == "bottom" else s
    src = Blocks(plat, LAYOUT, len(ids))
    src.write(block_bytes(ids, LAYOUT.shard_bytes))
    assert (target.wait(target.dump(ids, 0, src.addrs)) == OK).all()
    src.free()


@pytest.mark.parametrize("site", ["top", "bottom"])
def test_same_size_corruption_is_never_served(store_spec, tmp_path, plat, site):
    """A byte flipped where the store keeps the block (file on disk, cache slot, pool window)
    makes that block CORRUPT, never a hit with the flipped bytes; the bad copy is dropped. With
    verification off the same flip is served: the test can fail."""
    tiers = store_spec.split("|")
    if site == "bottom" and len(tiers) == 1:
        pytest.skip("one tier: its bytes are planted by site=top")
    s = build_store(store_spec, tmp_path, plat)
    try:
        planted = (s.upper if site == "top" else s.lower) if len(tiers) > 1 else s
        ids = random_ids(4, 20)
        data = block_bytes(ids, LAYOUT.shard_bytes)
        _dump_to(s, site, ids, plat)
        plant_flip(planted, ids[1])
        dst = Blocks(plat, LAYOUT, 4)
        st = load_all(s, ids, dst)
        assert st.tolist() == [OK, CORRUPT, OK, OK]
        ok = st == OK
        assert np.array_equal(dst.read()[ok], data[ok])
        assert s.stats()["corrupt_blocks"] >= 1 and s.stats()["load_corrupt"] == 1
        again = Blocks(plat, LAYOUT, 1)
        st = load_all(s, ids[1:2], again)
        if site == "top" and len(tiers) > 1:  # the cache dropped its slot; the lower copy is good
            assert st.tolist() == [OK] and np.array_equal(again.read()[0], data[1])
        else:  # the only copy was dropped: a miss, and the next dump writes it again
            assert st.tolist() == [MISSING] and not s.lookup(ids[1:2]).any()
            _dump_to(s, site, ids[1:2], plat)
            assert load_all(s, ids[1:2], again).tolist() == [OK]
            assert np.array_equal(again.read()[0], data[1])
        # negative control: the same flip with verification off is served as a hit
        ids2 = random_ids(2, 21)
        _dump_to(s, site, ids2, plat)
        plant_flip(planted, ids2[0])
        s.set_verify("off")
        out = Blocks(plat, LAYOUT, 2)
        assert load_all(s, ids2, out).tolist() == [OK, OK]
        got, want = out.read(), block_bytes(ids2, LAYOUT.shard_bytes)
        assert np.flatnonzero(got[0] != want[0]).tolist() == [FLIP_AT] and np.array_equal(got[1], want[1])
    finally:
        s.close()


# ---------------------------------------------------------------------------- concurrency
def _in_threads(fn, n):
    """``[fn(0), ..., fn(n - 1)]``, each on its own thread (None for one that did not end
    within 60 s)."""
    results = [None] * n

    def run(k):
        results[k] = fn(k)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_concurrent_dumps_of_the_same_ids(store, plat):
    ids = random_ids(N, 6)
    data = block_bytes(ids, LAYOUT.shard_bytes)
    srcs = [Blocks(plat, LAYOUT, N) for _ in range(4)]
    for b in srcs:
        b.write(data)
    barrier = threading.Barrier(4)

    def run(k):
        barrier.wait()
        return dump_all(store, ids, srcs[k])

    results = _in_threads(run, 4)
    assert all(r is not None and (r == OK).all() for r in results), results
    dst = Blocks(plat, LAYOUT, N)
    assert (load_all(store, ids, dst) == OK).all()
    assert np.array_equal(dst.read(), data)


def test_concurrent_loads_of_the_same_ids(store, plat):
    ids = random_ids(N, 7)
    data = block_bytes(ids, LAYOUT.shard_bytes)
    src = Blocks(plat, LAYOUT, N)
    src.write(data)
    assert (dump_all(store, ids, src) == OK).all()
    dsts = [Blocks(plat, LAYOUT, N) for _ in range(4)]
    results = _in_threads(lambda k: load_all(store, ids, dsts[k]), 4)
    for r, d in zip(results, dsts):
        assert r is not None and (r == OK).all()
        assert np.array_equal(d.read(), data)


# ---------------------------------------------------------------------------- bad arguments
def test_bad_arguments_are_clear_errors(store, plat):
    ids = random_ids(4, 13)
    b = Blocks(plat, LAYOUT, 4)
    with pytest.raises(ValueError, match=r"ids must be an \(n, 16\) uint8"):
        store.lookup(ids.astype(np.int64))
    with pytest.raises(ValueError, match=r"ids must be an \(n, 16\) uint8"):
        store.load(ids[:, :8], 0, b.addrs)
    with pytest.raises(ValueError, match=r"addrs must have shape \(4, 3\)"):
        store.load(ids, 0, b.addrs[:, :2])
    with pytest.raises(ValueError, match=r"addrs must have shape \(4, 3\)"):
        store.dump(ids, 0, b.addrs[:3])
    with pytest.raises(ValueError, match="non-negative integer addresses"):
        store.dump(ids, 0, b.addrs.astype(np.float64))
    with pytest.raises(ValueError, match="not inside any live buffer"):
        store.load(ids, 0, b.addrs + np.uint64(1 << 40))
    small = plat.alloc(LAYOUT.shard_bytes - 1, Medium.HBM)  # one byte short of the layout
    packed = small.ptr + LAYOUT.offsets.astype(np.int64)[None, :]
    with pytest.raises(ValueError, match=r"block 0, piece 2: 77 B .* piece sizes are \[4096, 1000, 77\]"):
        store.dump(ids[:1], 0, packed)
    with pytest.raises(ValueError, match="shard_idx 1 out of range"):
        store.load(ids, 1, b.addrs)
    with pytest.raises(TypeError, match="shard_idx must be an int"):
        store.load(ids, "0", b.addrs)
    with pytest.raises(TypeError, match="after must be None or an Event"):
        store.dump(ids, 0, b.addrs, after=object())
    other = build("sim")
    try:
        with pytest.raises(TypeError, match="after must be None or an Event"):
            store.dump(ids, 0, b.addrs, after=other.event())
    finally:
        other.close()
    t = store.load(ids, 0, b.addrs)
    with pytest.raises(ValueError, match="timeout must be >= 0"):
        store.wait(t, timeout=-1)
    store.wait(t)
    with pytest.raises(ValueError, match="single consumer"):
        store.wait(t)
    with pytest.raises(ValueError, match="not a task of this store"):
        store.wait(object())


def test_closed_store_refuses_calls(store_spec, tmp_path, plat):
    s = build_store(store_spec, tmp_path, plat)
    s.close()
    s.close()  # idempotent
    ids = random_ids(2, 14)
    with pytest.raises(ValueError, match="closed"):
        s.lookup(ids)
    with pytest.raises(ValueError, match="closed"):
        s.load(ids, 0, np.zeros((2, LAYOUT.pieces), np.uint64))
