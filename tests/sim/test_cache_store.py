"""The cache store beyond the contract: LRU, slots in use, de-duplication, sizing, collisions."""

from __future__ import annotations

import numpy as np
import pytest
from kvf_testing import segments
from stores import LAYOUT, dump_blocks, load_checked, random_ids

from kvfabric.errors import OutOfSpace
from kvfabric.platform.sim import SimPlatform
from kvfabric.ucm_layer.store.base import BlockStatus
from kvfabric.ucm_layer.store.cache import SLOT_ALIGN, CacheConfig, CacheStore
from kvfabric.ucm_layer.store.cache_index import _MIX_HI, Claim, SlotTable, keys_of

OK, MISSING, FAILED = int(BlockStatus.OK), int(BlockStatus.MISSING), int(BlockStatus.FAILED)
SLOT = -(-LAYOUT.shard_bytes // SLOT_ALIGN) * SLOT_ALIGN


@pytest.fixture
def plat():
    p = SimPlatform()
    yield p
    p.close()


def cache(plat, slots, **kw):
    return CacheStore(CacheConfig(capacity=slots * SLOT, **kw), platform=plat, layout=LAYOUT)


def test_lru_replacement_keeps_recently_used_blocks(plat):
    c = cache(plat, 4)
    ids = random_ids(6, 1)
    for i in range(4):  # one call each: distinct recency
        assert (dump_blocks(c, plat, ids[i : i + 1]) == OK).all()
    assert (load_checked(c, plat, ids[[0]]) == OK).all()  # block 0 is now the most recently used
    assert (dump_blocks(c, plat, ids[4:5]) == OK).all()  # evicts block 1, the least recently used
    assert c.lookup(ids[:5]).tolist() == [True, False, True, True, True]
    assert (dump_blocks(c, plat, ids[5:6]) == OK).all()  # then block 2
    assert c.lookup(ids).tolist() == [True, False, False, True, True, True]
    assert c.stats()["evictions"] == 2
    c.close()


def test_a_slot_in_use_is_never_evicted(plat):
    c = cache(plat, 4)
    ids = random_ids(5, 2)
    assert (dump_blocks(c, plat, ids[:4]) == OK).all()
    held = c.acquire(ids[:4], 0, claim=False)  # a reader holds all four slots
    assert (held.kinds == Claim.HIT).all() and c.stats()["slots_pinned"] == 4
    assert (dump_blocks(c, plat, ids[4:]) == FAILED).all()  # no slot can be taken
    assert c.lookup(ids[:4]).all()
    c.table.release(held.slots)
    assert (dump_blocks(c, plat, ids[4:]) == OK).all()
    assert c.lookup(ids).sum() == 4
    c.close()


def test_one_owner_fills_others_wait():
    t = SlotTable(8)
    ids = random_ids(3, 3)
    keys = keys_of(ids, 0)
    first = t.acquire(keys, ids, 0, claim=True)
    assert (first.kinds == Claim.OWN).all()
    second = t.acquire(keys, ids, 0, claim=True)
    assert (second.kinds == Claim.WAIT).all()  # being filled: wait, do not fill again
    assert not t.present(ids, 1).any()  # nothing visible while filling
    assert not t.wait_settled(keys, ids, 0, 0.01)
    t.publish(first.slots, np.array([True, True, False]), pinned=first.slots)
    assert t.wait_settled(keys, ids, 0, 0.01)
    assert t.present(ids, 1).tolist() == [True, True, False]
    third = t.acquire(keys, ids, 0, claim=True)
    assert third.kinds.tolist() == [Claim.HIT, Claim.HIT, Claim.OWN]  # the failed one is claimable again
    t.release(first.slots[:2])
    t.release(third.slots)
    assert (t.refs >= 0).all()


def test_duplicate_rows_follow_their_first():
    t = SlotTable(8)
    ids = random_ids(2, 4)[[0, 1, 0, 0]]
    c = t.acquire(keys_of(ids, 0), ids, 0, claim=True)
    assert (c.kinds == Claim.OWN).all() and c.first.tolist() == [True, True, False, False]
    assert c.slots[0] == c.slots[2] == c.slots[3] != c.slots[1]
    assert t.refs[c.slots[0]] == 3  # one pin per row


def test_key_collision_is_a_miss_never_wrong_bytes(plat):
    c = cache(plat, 8)
    a = random_ids(1, 5)
    w = a.view("<u8").reshape(-1, 2).copy()
    w1 = w[0, 1] ^ np.uint64(0xFFFF)  # another id whose 64-bit key is the same
    with np.errstate(over="ignore"):
        w0 = w[0, 0] ^ (w[0, 1] * _MIX_HI) ^ (w1 * _MIX_HI)
    b = np.array([[w0, w1]], np.uint64).view(np.uint8).reshape(1, 16)
    assert keys_of(a, 0)[0] == keys_of(b, 0)[0] and not np.array_equal(a, b)
    assert (dump_blocks(c, plat, a) == OK).all()
    assert not c.lookup(b).any()
    assert (dump_blocks(c, plat, b) == FAILED).all()  # uncacheable while a holds the key
    assert (load_checked(c, plat, b) == MISSING).all() and (load_checked(c, plat, a) == OK).all()
    c.close()


def test_capacity_is_checked_at_start(plat):
    with pytest.raises(ValueError, match="holds no slot"):
        CacheStore(CacheConfig(capacity=100), platform=plat, layout=LAYOUT)
    with pytest.raises(OutOfSpace, match="available memory"):
        CacheStore(CacheConfig(capacity=1 << 50), platform=plat, layout=LAYOUT)
    with pytest.raises(OutOfSpace, match=r"free in .*kvf-test.*enlarge the tmpfs"):
        CacheStore(CacheConfig(capacity=1 << 50, shared=True), platform=plat, layout=LAYOUT)
    with pytest.raises(ValueError, match=r"cache\.capacity is required"):
        CacheConfig.from_mapping({"cache.shared": True})
    with pytest.raises(ValueError, match=r"bad value for config key cache\.shared"):
        CacheConfig.from_mapping({"cache.capacity": "1MiB", "cache.shared": "maybe"})


def test_shared_cache_lives_in_shared_memory_and_goes_with_close(plat, isolated_shm):
    before = segments(isolated_shm)
    c = cache(plat, 16, shared=True, prefault=True)
    assert c.buffer.shareable and len(segments(isolated_shm)) == len(before) + 1
    ids = random_ids(4, 6)
    assert (dump_blocks(c, plat, ids) == OK).all() and (load_checked(c, plat, ids) == OK).all()
    c.close()
    assert segments(isolated_shm) == before


def test_a_slot_that_fails_verification_is_dropped_and_reused(plat):
    from store_faults import plant_flip

    c = cache(plat, 4)
    ids = random_ids(4, 40)
    assert (dump_blocks(c, plat, ids) == OK).all()
    assert np.count_nonzero(c.table.digest) == 4  # every published slot carries its digest
    plant_flip(c, ids[2])
    st = load_checked(c, plat, ids)  # OK blocks are checked bit-exact
    assert st.tolist() == [OK, OK, int(BlockStatus.CORRUPT), OK]
    stats = c.stats()
    assert stats["corrupt_blocks"] == 1 and stats["slots_ready"] == 3 and stats["slots_pinned"] == 0
    assert c.lookup(ids).tolist() == [True, True, False, True]
    assert len(c.table.free) == 1  # the dropped slot went back to the free list with its last pin
    assert (dump_blocks(c, plat, ids[2:3]) == OK).all()  # rewritten into it
    assert (load_checked(c, plat, ids) == OK).all()
    c.close()
