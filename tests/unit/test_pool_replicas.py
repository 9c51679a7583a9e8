"""Replicas in the meta service: placement on distinct nodes, bad counts, and what each
extent does through commit, read leases, rank loss, eviction, removal, TTL, the write
fence and re-registration (the new leader merges the extents of one key)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from kvfabric.platform.types import Medium
from kvfabric.pool import protocol as p
from kvfabric.pool import table as tbl
from kvfabric.pool.config import PoolConfig
from kvfabric.pool.service.dispatch import Dispatcher
from kvfabric.pool.service.meta import MetaService
from kvfabric.pool.service.replicas import replica_key
from kvfabric.pool.status import Status
from kvfabric.pool.table import SlotState
from kvfabric.pool.windows import FixedStride

KiB = 1024
NODES = {1: "node-a", 2: "node-a", 3: "node-b", 4: "node-c"}  # ranks 1 and 2 share a node


@pytest.fixture
def env():
    clock = SimpleNamespace(t=1000.0)  # the service's monotonic seconds, moved by the tests
    view = tbl.create(256)
    cfg = PoolConfig(dram=0, max_objects=256, write_lease_s=5, read_lease_s=2, fence_grace_s=30)
    svc = MetaService(cfg, view, FixedStride(), clock=lambda: clock.t)
    for rank in NODES:
        svc.add_window(rank, Medium.DRAM, 64 * KiB)
    yield svc, clock
    view.close()
    view.seg.unlink()


def rank_of(svc: MetaService, gva: int) -> int:
    return svc.addr.decode(gva)[1]


def alloc(svc: MetaService, key: bytes, size: int, n: int, client: str = "c", **kw) -> list[int]:
    """Every extent of ``key`` (placed with ``NODES``), the first one first; [] when refused."""
    st, gvas, _ = svc.alloc(client, [key], [size], replicas=n, nodes=NODES, **kw)
    return [gvas[0], *svc.extents(key)] if st == [Status.OK] else []


def put(svc: MetaService, key: bytes, n: int, size: int = 4 * KiB, home: int | None = 1) -> list[int]:
    extents = alloc(svc, key, size, n, home_rank=home)
    assert extents
    assert svc.commit("c", [key], [True], sums=[0xABC]) == [Status.OK]
    return extents


def test_extents_go_to_distinct_nodes_first_then_distinct_ranks(env):
    svc, _ = env
    three = put(svc, b"three", 3)
    assert rank_of(svc, three[0]) == 1  # the writer's own rank first
    assert {NODES[rank_of(svc, g)] for g in three} == {"node-a", "node-b", "node-c"}
    four = put(svc, b"four", 4)  # 3 nodes: the 4th copy on the unused rank of a used node
    assert sorted(rank_of(svc, g) for g in four) == [1, 2, 3, 4]
    assert svc.counters.under_replicated == 0


def test_a_full_window_of_another_node_evicts_before_a_copy_goes_to_the_same_node(env):
    svc, _ = env
    svc.drop_rank(4)  # node-a: ranks 1 and 2; node-b: rank 3
    for i in range(7):  # 56 KiB of rank 3's 64 KiB (under the high watermark)
        assert alloc(svc, f"b{i}".encode(), 8 * KiB, 1, preferred_rank=3)
        assert svc.commit("c", [f"b{i}".encode()], [True]) == [Status.OK]
    extents = put(svc, b"new", 2, size=12 * KiB, home=1)
    assert [rank_of(svc, g) for g in extents] == [1, 3] and svc.counters.evicted_objects >= 1


def test_more_replicas_than_ranks_places_as_many_as_there_are_and_says_so(env):
    svc, _ = env
    extents = put(svc, b"k", 6)
    assert len(extents) == 4 and len({rank_of(svc, g) for g in extents}) == 4
    assert svc.counters.under_replicated == 1
    st, _, _, _, _, _, extra = svc.lookup_extents([b"k"], lease=False)
    assert st == [Status.OK] and len(extra[0]) == 3


@pytest.mark.parametrize("bad", [0, -1, 9, 2.5, True, "2"])
def test_bad_replica_counts_are_refused_naming_the_value(bad):
    with pytest.raises(ValueError, match="replicas"):
        p.check_replicas(bad)


@pytest.mark.parametrize("bad", [0, 9, "many"])
def test_bad_replicas_in_the_pool_config_are_refused(bad):
    with pytest.raises(ValueError, match="replicas"):
        PoolConfig(replicas=bad)


def test_a_bad_replicas_request_is_refused_whole_by_the_dispatcher(env):
    svc, _ = env
    d = Dispatcher(svc, 1, {})
    reply = d.handle(p.Alloc("c", [b"k"], [KiB], replicas=9))
    assert "replicas = 9" in reply.error and not reply.status
    assert svc.table.find(b"k") is None


def test_an_object_of_n_extents_is_one_object_with_n_slots_until_committed_whole(env):
    svc, _ = env
    extents = alloc(svc, b"k", KiB, 2, home_rank=1)
    assert len(extents) == 2
    assert svc.table.find(replica_key(b"k", 1)).state is SlotState.ALLOCATED
    assert svc.exists([b"k"]) == [False]
    assert svc.commit("c", [b"k"], [True], sums=[7]) == [Status.OK]
    r = svc.table.find(replica_key(b"k", 1))
    assert r.state is SlotState.REPLICA and r.csum == 7 and r.gva == extents[1]
    assert svc.replica_slots() == 1
    assert svc.remove([b"k"]) == [Status.OK]
    assert svc.table.find(replica_key(b"k", 1)) is None
    assert all(w.alloc.used == 0 for w in svc.windows.values())


def test_an_abandoned_put_frees_every_extent(env):
    svc, _ = env
    assert len(alloc(svc, b"k", KiB, 3)) == 3
    assert svc.commit("c", [b"k"], [False]) == [Status.OK]
    assert svc.table.count == 0 and all(w.alloc.used == 0 for w in svc.windows.values())


def test_a_dead_rank_leaves_its_objects_readable_from_the_other_extent(env):
    svc, _ = env
    a = put(svc, b"primary-dies", 2, home=1)
    c = put(svc, b"alone", 1, home=1)
    b = put(svc, b"replica-dies", 2, home=3)
    assert rank_of(svc, a[0]) == 1 and rank_of(svc, c[0]) == 1 and rank_of(svc, b[0]) == 3
    assert svc.drop_rank(1) == 1  # only the object of one extent is gone
    st, gvas, _, _, _, sums, extra = svc.lookup_extents([b"primary-dies", b"alone"], False)
    assert st == [Status.OK, Status.NOT_FOUND]
    assert gvas[0] == a[1] and extra[0] == [] and sums[0] == 0xABC  # the replica took over
    assert svc.counters.promoted == 1
    assert svc.drop_rank(rank_of(svc, b[1])) == 0  # b's replica goes; b stays at its primary
    st, gvas, *_, extra = svc.lookup_extents([b"replica-dies"], False)
    assert st == [Status.OK] and gvas == [b[0]] and extra == [[]]
    assert svc.replica_slots() == 0 and svc.counters.replicas_lost == 2


def test_a_put_in_flight_that_loses_a_rank_is_lost_whole_and_its_other_extent_fenced(env):
    svc, _ = env
    other = svc._window_of(alloc(svc, b"k", KiB, 2, client="w", home_rank=1)[1])
    assert svc.drop_rank(1) == 1
    assert svc.table.find(b"k") is None and svc.table.find(replica_key(b"k", 1)) is None
    assert other.alloc.used > 0  # the writer may still copy into it: fenced, not free
    assert svc.commit("w", [b"k"], [True]) == [Status.LEASE_EXPIRED]  # the writer is done with it
    assert other.alloc.used == 0


def test_an_expired_write_lease_fences_every_extent_until_the_writer_is_done(env):
    svc, clock = env
    assert len(alloc(svc, b"k", KiB, 3, client="w")) == 3
    clock.t += 6
    svc.tick()
    assert svc.table.find(b"k") is None and svc.table.find(replica_key(b"k", 2)) is None
    assert len(svc.fence.fences) == 3
    assert svc.commit("w", [b"k"], [True]) == [Status.LEASE_EXPIRED]
    assert not svc.fence.fences and all(w.alloc.used == 0 for w in svc.windows.values())


def test_eviction_in_one_window_takes_every_extent_of_its_victims(env):
    svc, _ = env
    svc.drop_rank(2), svc.drop_rank(4)  # two windows left: every object has an extent in each
    keys = [f"old{i}".encode() for i in range(7)]
    for k in keys:  # 7 x 8 KiB in each 64 KiB window (high watermark 0.9)
        put(svc, k, 2, size=8 * KiB, home=1)
    assert svc.counters.evicted_objects == 0
    put(svc, b"new", 2, size=8 * KiB, home=1)
    assert svc.counters.evicted_objects >= 1
    for k in keys:  # each object is there whole or gone whole
        assert (svc.table.find(k) is None) == (svc.table.find(replica_key(k, 1)) is None)
    assert sum(svc.table.find(k) is None for k in keys) == svc.counters.evicted_objects
    w1, w3 = svc.windows[(1, Medium.DRAM)], svc.windows[(3, Medium.DRAM)]
    assert w1.alloc.used == w3.alloc.used == 8 * KiB * (8 - svc.counters.evicted_objects)


def test_a_read_lease_holds_every_extent_of_a_removed_object(env):
    svc, _ = env
    a, b = put(svc, b"k", 2)
    _st, *_, lids, _, _ = svc.lookup_extents([b"k"])
    assert svc.remove([b"k"]) == [Status.OK]
    assert svc._window_of(b).alloc.used > 0  # still held: a reader may copy from it
    assert svc.release(lids) == [Status.OK]
    assert svc._window_of(a).alloc.used == 0 and svc._window_of(b).alloc.used == 0


def test_removing_one_corrupt_extent_keeps_the_object_until_its_last(env):
    svc, _ = env
    a, b = put(svc, b"k", 2)
    assert svc.remove([b"k"], gvas=[a]) == [Status.OK]  # the primary: the replica takes over
    st, gvas, *_, extra = svc.lookup_extents([b"k"], False)
    assert st == [Status.OK] and gvas == [b] and extra == [[]]
    assert svc.remove([b"k"], gvas=[a]) == [Status.NOT_FOUND]
    assert svc.remove([b"k"], gvas=[b]) == [Status.OK]
    assert svc.exists([b"k"]) == [False]


def test_ttl_expires_every_extent(env):
    svc, _ = env
    assert len(alloc(svc, b"k", KiB, 2)) == 2
    svc.commit("c", [b"k"], [True], ttl_s=0.05)
    time.sleep(0.25)
    svc.tick()
    assert svc.table.count == 0 and all(w.alloc.used == 0 for w in svc.windows.values())


def test_reregistration_merges_the_extents_of_one_key_and_drops_stale_ones(env):
    svc, _ = env
    a, b = put(svc, b"k", 2)
    gen = svc.table.find(b"k").gen
    view = tbl.create(256)
    try:
        new = MetaService(svc.config, view, FixedStride())
        for rank in NODES:
            new.add_window(rank, Medium.DRAM, 64 * KiB)
        # each owner re-registers its own extent: they arrive apart and become one entry
        assert new.reregister([b"k"], [b], [KiB * 4], [gen], [0xABC]) == [Status.OK]
        assert new.reregister([b"k"], [a], [KiB * 4], [gen], [0xABC]) == [Status.OK]
        assert new.reregister([b"k"], [a], [KiB * 4], [gen], [0xABC]) == [Status.EXISTS]
        st, gvas, _, _, _, _, extra = new.lookup_extents([b"k"], False)
        assert st == [Status.OK] and sorted([gvas[0], *extra[0]]) == sorted([a, b])
        assert new.table.count == 2  # one object, one replica slot
        # an extent of an older generation (removed, then put again) changes nothing
        assert new.reregister([b"k"], [a + 8 * KiB], [KiB * 4], [gen - 1], [0x1]) == [Status.EXISTS]
        # a newer generation replaces the entry
        assert new.reregister([b"k"], [a + 16 * KiB], [KiB * 4], [gen + 5], [0x2]) == [Status.OK]
        st, gvas, _, gens, _, sums, extra = new.lookup_extents([b"k"], False)
        assert gvas == [a + 16 * KiB] and gens == [gen + 5] and sums == [0x2] and extra == [[]]
        held = new.held(rank_of(svc, a))
        assert held[0] == [b"k"] and held[1] == [a + 16 * KiB]
    finally:
        view.close()
        view.seg.unlink()


def test_held_lists_primaries_and_replicas_of_a_rank_by_their_keys(env):
    svc, _ = env
    svc.drop_rank(2), svc.drop_rank(4)
    put(svc, b"x", 2, home=1)
    put(svc, b"y", 2, home=3)  # its replica on rank 1, the one other window
    keys, gvas, sizes, _gens, sums = svc.held(1)
    assert sorted(keys) == [b"x", b"y"] and all(rank_of(svc, g) == 1 for g in gvas)
    assert sums == [0xABC, 0xABC] and sizes == [4 * KiB, 4 * KiB]


@pytest.mark.parametrize("bad", [9, -1, "x", 1.5, True])
def test_the_pool_store_config_checks_replicas_and_names_the_key(bad):
    from kvfabric.ucm_layer.store.pool import PoolStoreConfig

    assert PoolStoreConfig.from_mapping({"pool": {"replicas": 2}}).replicas == 2
    assert PoolStoreConfig.from_mapping({}).replicas == 0  # the daemon's
    with pytest.raises(ValueError, match=r"pool\.replicas"):
        PoolStoreConfig.from_mapping({"pool.replicas": bad})
