"""MetaService semantics: put-if-absent, states, leases, eviction, TTL, ranks, rebuild."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvfabric.platform.types import Medium
from kvfabric.pool import table as tbl
from kvfabric.pool.config import PoolConfig
from kvfabric.pool.service.meta import MetaService
from kvfabric.pool.status import Status
from kvfabric.pool.table import SlotState
from kvfabric.pool.windows import FixedStride

KiB = 1024


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def env():
    clock = Clock()
    view = tbl.create(256)
    cfg = PoolConfig(dram=0, max_objects=256, write_lease_s=5, read_lease_s=2)
    svc = MetaService(cfg, view, FixedStride(), clock=clock)
    svc.add_window(0, Medium.DRAM, 100 * KiB)
    yield svc, clock
    view.close()
    view.seg.unlink()


def put(svc, key: bytes, size: int, client: str = "c") -> int:
    st, gvas, _ = svc.alloc(client, [key], [size])
    assert st == [Status.OK]
    assert svc.commit(client, [key], [True]) == [Status.OK]
    return gvas[0]


def state(svc, key: bytes):
    hit = svc.table.find(key)
    return None if hit is None else hit.state


def test_put_if_absent_and_states(env):
    svc, _ = env
    st, gvas, gens = svc.alloc("a", [b"k"], [1000])
    assert st == [Status.OK] and gens[0] > 0
    assert state(svc, b"k") is SlotState.ALLOCATED
    assert svc.exists([b"k"]) == [False]  # nothing ALLOCATED is visible
    assert svc.lookup([b"k"])[0] == [Status.NOT_FOUND]
    assert svc.alloc("b", [b"k"], [1000])[0] == [Status.EXISTS]  # a concurrent saver
    assert svc.commit("b", [b"k"], [True]) == [Status.LEASE_EXPIRED]  # not b's allocation
    assert svc.commit("a", [b"k"], [True]) == [Status.OK]
    assert svc.exists([b"k"]) == [True] and state(svc, b"k") is SlotState.READABLE
    assert svc.alloc("b", [b"k"], [5])[0] == [Status.EXISTS]
    hit = svc.table.find(b"k")
    assert hit.gva == gvas[0] and hit.size == 1000  # untouched


def test_failed_write_frees_the_space(env):
    svc, _ = env
    svc.alloc("a", [b"k"], [50 * KiB])
    w = svc.windows[(0, Medium.DRAM)]
    assert w.alloc.used == 50 * KiB
    assert svc.commit("a", [b"k"], [False]) == [Status.OK]
    assert w.alloc.used == 0 and state(svc, b"k") is None


def fenced(svc) -> list[SlotState]:
    s = svc.table.slots
    return [SlotState(int(x)) for x in s["state"][(s["hash"] != 0) & (s["state"] == SlotState.REMOVING)]]


def test_write_lease_expiry_fences_the_space_until_grace(env):
    """A writer that cannot be watched (no pid): its space stays fenced for fence_grace_s."""
    svc, clock = env
    w = svc.windows[(0, Medium.DRAM)]
    svc.alloc("dead-client", [b"k"], [10 * KiB])
    clock.t += 6
    svc.tick()
    assert state(svc, b"k") is None  # the key is free for a new put...
    assert w.alloc.used == 10 * KiB and fenced(svc) == [SlotState.REMOVING]  # ...its space is not
    put(svc, b"k", 90 * KiB, client="other")  # the rest of the window is usable
    clock.t += svc.config.fence_grace_s + 1
    svc.tick()
    assert fenced(svc) == [] and w.alloc.used == 90 * KiB


def test_late_commit_releases_the_fence_and_is_refused(env):
    svc, clock = env
    w = svc.windows[(0, Medium.DRAM)]
    gva = svc.alloc("slow", [b"k"], [10 * KiB], pid=os.getpid())[1][0]
    clock.t += 6
    svc.tick()
    clock.t += 10 * svc.config.fence_grace_s
    svc.tick()  # a live writer on this node: no grace, it may still be copying
    assert w.alloc.used == 10 * KiB
    second = svc.alloc("fast", [b"k2"], [100 * KiB - 10 * KiB])
    assert second[0] == [Status.OK] and not (second[1][0] <= gva < second[1][0] + 90 * KiB)
    assert svc.commit("slow", [b"k"], [True], sums=[7]) == [Status.LEASE_EXPIRED]  # never published
    assert fenced(svc) == [] and state(svc, b"k") is None
    assert w.alloc.used == 90 * KiB  # the writer said it is done: space back


def test_fence_of_a_dead_writer_is_released(env):
    svc, clock = env
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    svc.alloc("gone", [b"k"], [10 * KiB], pid=proc.pid)
    clock.t += 6
    svc.tick()
    assert svc.windows[(0, Medium.DRAM)].alloc.used == 0 and fenced(svc) == []


def test_renew_keeps_a_long_write_alive(env):
    svc, clock = env
    svc.alloc("c", [b"k"], [KiB])
    for _ in range(4):
        clock.t += 4
        assert svc.renew("c", [b"k"]) == [Status.OK]
        svc.tick()
    assert svc.renew("other", [b"k"]) == [Status.LEASE_EXPIRED]
    assert svc.commit("c", [b"k"], [True], sums=[42]) == [Status.OK]
    assert svc.table.find(b"k").csum == 42
    assert svc.lookup([b"k"], lease=False)[5] == [42]


def test_remote_lookup_does_not_disturb_on_node_readers(env):
    svc, _ = env
    put(svc, b"k", KiB)
    seq = svc.table.find(b"k").seq
    svc.lookup([b"k"], lease=False)
    svc.lookup([b"k"], lease=True)
    assert svc.table.find(b"k").seq == seq  # recency is marked outside the slot's counter


def test_full_directory_evicts_the_least_recently_used(env):
    svc, _ = env
    cap = svc.table.capacity
    for i in range(cap):
        put(svc, f"k{i}".encode(), 16)
    svc.table.view.touch(svc.table.find(b"k7").slot, 1)  # the least recently used
    st, _, _ = svc.alloc("c", [b"new"], [16])
    assert st == [Status.OK]
    assert svc.counters.evicted_objects == 1 and state(svc, b"k7") is None
    assert svc.commit("dead-client", [b"k"], [True]) == [Status.LEASE_EXPIRED]


def test_read_leases_block_eviction_and_defer_frees(env):
    svc, _clock = env
    gva = put(svc, b"leased", 30 * KiB)
    st, gvas, sizes, _gens, lids, _sums = svc.lookup([b"leased"])
    assert st == [Status.OK] and gvas == [gva] and sizes == [30 * KiB] and lids[0] > 0
    for i in range(10):  # fill: LRU eviction must skip the leased object
        put(svc, f"filler{i}".encode(), 20 * KiB)
    assert state(svc, b"leased") is SlotState.READABLE
    assert svc.remove([b"leased"]) == [Status.OK]
    assert svc.exists([b"leased"]) == [False]  # gone from the directory at once...
    w = svc.windows[(0, Medium.DRAM)]
    used = w.alloc.used
    assert svc.release(lids) == [Status.OK]  # ...its space freed when the lease ends
    assert w.alloc.used == used - 30 * KiB


def test_expired_read_lease_reports_it(env):
    svc, clock = env
    put(svc, b"k", KiB)
    lid = svc.lookup([b"k"])[4]
    clock.t += 3
    assert svc.release(lid) == [Status.LEASE_EXPIRED]
    assert svc.release(lid) == [Status.LEASE_EXPIRED]  # unknown lease


def test_lru_eviction_by_bytes_between_watermarks(env):
    svc, _ = env
    w = svc.windows[(0, Medium.DRAM)]
    for i in range(9):
        put(svc, f"o{i}".encode(), 10 * KiB)
        svc.table.update(svc.table.find(f"o{i}".encode()).slot, atime=100 + i)  # o0 is the oldest
    svc.table.update(svc.table.find(b"o0").slot, atime=500)  # a reader touched o0 last
    put(svc, b"big", 25 * KiB)  # needs eviction: 90 KiB used of 100
    gone = [i for i in range(9) if state(svc, f"o{i}".encode()) is None]
    assert gone[:2] == [1, 2] and 0 not in gone
    assert w.alloc.used <= 0.8 * w.size + 25 * KiB
    assert w.evictions == len(gone) and svc.counters.evicted_bytes == 10 * KiB * len(gone)


def test_no_space_when_nothing_can_go(env):
    svc, _ = env
    put(svc, b"k", 60 * KiB)
    svc.lookup([b"k"])  # leased
    st, _, _ = svc.alloc("c", [b"huge"], [70 * KiB])
    assert st == [Status.NO_SPACE]
    assert svc.alloc("c", [b"bad"], [0])[0] == [Status.INVALID]


def test_ttl(env):
    svc, _ = env
    svc.alloc("c", [b"k"], [KiB])
    svc.commit("c", [b"k"], [True], ttl_s=0.0001)
    import time

    time.sleep(0.25)  # TTLs count in ticks of 0.1 s of the node's monotonic clock
    assert svc.exists([b"k"]) == [False]


def test_placement_prefers_home_then_preferred(env):
    svc, _ = env
    svc.add_window(3, Medium.DRAM, 100 * KiB)
    stride = svc.addr.stride
    _, g, _ = svc.alloc("c", [b"a"], [KiB], home_rank=3)
    assert svc.addr.decode(g[0])[1] == 3
    _, g, _ = svc.alloc("c", [b"b"], [KiB], home_rank=3, preferred_rank=0)
    assert svc.addr.decode(g[0])[1] == 0
    assert stride == 1 << 40


def test_rank_leaving_removes_its_objects_now(env):
    svc, _ = env
    svc.add_window(1, Medium.DRAM, 100 * KiB)
    put(svc, b"on1", KiB, client="x")
    svc.alloc("x", [b"elsewhere"], [KiB], preferred_rank=0)
    _st, g, _ = svc.alloc("x", [b"on1b"], [KiB], preferred_rank=1)
    assert svc.addr.decode(g[0])[1] == 1
    before = svc.table.count
    removed = svc.drop_rank(1)
    assert removed >= 1 and svc.table.count == before - removed
    assert (1, Medium.DRAM) not in svc.windows
    assert svc.exists([b"on1b"]) == [False]


def test_reregister_rebuilds(env):
    svc, _ = env
    gva = svc.addr.encode(Medium.DRAM, 0, 4096)
    assert svc.reregister([b"r"], [gva], [1000], [77]) == [Status.OK]
    assert svc.exists([b"r"]) == [True]
    assert svc.reregister([b"r"], [gva], [1000], [77]) == [Status.EXISTS]
    bad = svc.addr.encode(Medium.DRAM, 9, 0)
    assert svc.reregister([b"x"], [bad], [10], [1]) == [Status.INVALID]
    _, g, gens = svc.alloc("c", [b"new"], [KiB])
    assert gens[0] > 77 and g[0] != gva


def test_remove_all_and_capacity(env):
    svc, _ = env
    for i in range(5):
        put(svc, f"k{i}".encode(), KiB)
    assert svc.remove_all() == 5 and svc.table.count == 0
    (row,) = svc.capacity()
    assert row["used"] == 0 and row["capacity"] == 100 * KiB


def test_remove_does_not_see_a_put_in_flight(env):
    svc, _ = env
    svc.alloc("w", [b"k"], [KiB])
    assert svc.remove([b"k"]) == [Status.NOT_FOUND]  # invisible while being written
    assert svc.remove_all() == 0
    assert svc.commit("w", [b"k"], [True]) == [Status.OK]
    assert svc.remove([b"k"]) == [Status.OK] and svc.exists([b"k"]) == [False]


def test_many_leases_expiring_in_one_tick_are_all_fenced(env):
    """Fencing removes slots, which moves others (backward shift): every key still fenced."""
    svc, clock = env
    keys = [f"batch{i}".encode() for i in range(40)]
    svc.alloc("stalled", keys, [KiB] * len(keys))
    clock.t += 6
    svc.tick()
    assert all(state(svc, k) is None for k in keys)
    assert len(fenced(svc)) == len(keys) and svc.counters.fences == len(keys)
    assert svc.windows[(0, Medium.DRAM)].alloc.used == len(keys) * KiB
    assert svc.commit("stalled", keys, [True] * len(keys)) == [Status.LEASE_EXPIRED] * len(keys)
    assert fenced(svc) == [] and svc.windows[(0, Medium.DRAM)].alloc.used == 0
