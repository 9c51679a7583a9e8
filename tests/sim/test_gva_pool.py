"""Several processes form a GVA pool on one machine and copy between every pair of windows."""

from __future__ import annotations

import itertools
import os
import signal
import time

import numpy as np
import pytest
from gva_worker import Worker, pattern
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfabric.errors import RankUnavailable
from kvfabric.platform.types import Medium
from kvfabric.pool.gva.config import GvaConfig
from kvfabric.pool.gva.fabric import Fabric, MembershipChange
from kvfabric.pool.gva.rendezvous.server import RendezvousServer
from kvfabric.status import ItemStatus

WIN = 1 << 20


@pytest.fixture
def server():
    with RendezvousServer(session_ttl=2.0) as srv:
        yield srv


def _start(url: str, n: int, windows: dict[str, int] | None = None, **cfg) -> list[Worker]:
    workers = []
    try:
        for _ in range(n):
            workers.append(Worker.start(url, windows or {"dram": WIN}, **cfg))
    except BaseException:
        for w in workers:
            w.stop()
        raise
    return workers


def _window(fab: Fabric, rank: int, medium: str = "dram") -> np.ndarray:
    seg = fab.table.segment(Medium(medium), rank)
    return fab.resolve(seg.base, seg.nbytes).buffer.numpy()


@pytest.mark.parametrize("nproc", [2, 4])
def test_every_process_copies_between_every_pair_of_windows(server, nproc):
    workers = _start(server.url, nproc)
    observer = Fabric.join(server.url, "sim")  # metadata-only: no window, maps all of them
    try:
        table = observer.wait_for(lambda t: len(t.members) == nproc + 1, 30)
        ranks = [w.rank for w in workers]
        assert sorted(ranks) == sorted(r for r in table.ranks if r != observer.rank)
        pairs = [(i, j) for i, j in itertools.permutations(ranks, 2)]
        expect = {r: pattern(WIN, r).copy() for r in ranks}
        size = 4096 + 123  # not a multiple of anything
        for k, w in enumerate(workers):
            batch = []
            for p, (i, j) in enumerate(pairs):
                src_off = 7 * (p + 1)
                dst_off = 65536 + (k * len(pairs) + p) * 2 * size + 1  # disjoint from sources and each other
                src = table.gva(Medium.DRAM, i, src_off)
                dst = table.gva(Medium.DRAM, j, dst_off)
                if p % 2:
                    w.ok("xcopy", dst, src, size)
                else:
                    batch.append((dst, src, size))
                expect[j][dst_off : dst_off + size] = pattern(WIN, i)[src_off : src_off + size]
            w.ok("batch", batch)  # several rank pairs in one call: grouped per pair
        for r in ranks:
            np.testing.assert_array_equal(_window(observer, r), expect[r], err_msg=f"window of rank {r}")
    finally:
        observer.leave()
        for w in workers:
            w.stop()


@pytest.fixture(scope="module")
def trio():
    """A module-wide pool: this process (rank with a window) and two workers."""
    old = os.environ.get("KVFABRIC_SHM_DIR")
    import tempfile

    with tempfile.TemporaryDirectory(
        prefix="kvf-test-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
    ) as d:
        os.environ["KVFABRIC_SHM_DIR"] = d
        with RendezvousServer() as srv:
            workers = _start(srv.url, 2, {"dram": 256 << 10, "hbm": 128 << 10})
            me = Fabric.join(srv.url, "sim", {"dram": 192 << 10})
            try:
                me.wait_for(lambda t: len(t.members) == 3, 30)
                for w in workers:  # workers copy into this process's window too
                    w.ok("members", 3, 30)
                yield me, workers
            finally:
                me.leave()
                for w in workers:
                    w.stop()
        if old is None:
            os.environ.pop("KVFABRIC_SHM_DIR", None)
        else:
            os.environ["KVFABRIC_SHM_DIR"] = old


_copy = st.tuples(
    st.integers(0, 5),  # src: one of the 5 windows, or 5 = a local buffer of this process
    st.integers(0, 5),  # dst
    st.integers(0, 1 << 30),  # src offset seed
    st.integers(0, 1 << 30),  # dst offset seed
    st.integers(1, 40000),  # size
    st.integers(0, 2),  # copier: 0 this process, 1..2 a worker
)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(copies=st.lists(_copy, min_size=1, max_size=12), seed=st.integers(0, 2**32 - 1))
def test_random_copies_through_random_windows_keep_every_byte(trio, copies, seed):
    """Random (src, dst, size) triples among every window and a local buffer, issued by
    random processes; a byte-exact model of all memory is checked at the end."""
    me, workers = trio
    table = me.table
    ends: list = [(s.medium, s.rank) for s in table.segments]
    assert len(ends) == 5
    local = me.platform.alloc(96 << 10, "dram")
    try:
        views = {w: _window(me, w[1], w[0].value) for w in ends}
        ends.append("local")
        views["local"] = local.numpy()
        rng = np.random.default_rng(seed)
        model = {}
        for w, v in views.items():
            v[:] = rng.integers(0, 256, v.size, dtype=np.uint8)
            model[w] = v.copy()

        def addr(w, off: int) -> int:
            return local.ptr + off if w == "local" else table.gva(w[0], w[1], off)

        for si, di, so, do, n, who in copies:
            sw, dw = ends[si], ends[di]
            ssz, dsz = model[sw].size, model[dw].size
            n = min(n, ssz, dsz)
            so, do = so % (ssz - n + 1), do % (dsz - n + 1)
            if sw == dw and so < do + n and do < so + n:
                continue  # overlapping ranges of one buffer: not a memcpy
            if "local" in (sw, dw):
                who = 0  # only this process can address its local buffer
            if who == 0:
                assert me.xcopy(addr(dw, do), addr(sw, so), n).wait(30).tolist() == [ItemStatus.OK]
            else:
                workers[who - 1].ok("xcopy", addr(dw, do), addr(sw, so), n)
            model[dw][do : do + n] = model[sw][so : so + n]
        for w in ends:
            np.testing.assert_array_equal(views[w], model[w], err_msg=f"{w}")
    finally:
        me.platform.free(local)


def test_killed_rank_is_removed_and_the_rest_keep_copying(server):
    workers = _start(server.url, 3)
    me = Fabric.join(server.url, "sim", {"dram": WIN})
    left: list[tuple[float, MembershipChange]] = []
    me.subscribe(lambda ch: left.append((time.monotonic(), ch)) if ch.left else None)
    try:
        table = me.wait_for(lambda t: len(t.members) == 4, 30)
        a, b, victim = workers
        g = {w.rank: table.gva(Medium.DRAM, w.rank, 0) for w in workers}
        pairs = [(g[b.rank], g[a.rank], 65536), (g[a.rank] + 65536, g[b.rank] + 65536, 65536)]
        a.conn.send(("spin", pairs, 3.0))
        time.sleep(0.5)
        t_kill = time.monotonic()
        os.kill(victim.proc.pid, signal.SIGKILL)
        me.wait_for(lambda t: victim.rank not in t.ranks, 10)
        seen = time.monotonic() - t_kill
        assert seen < 5.0, f"the death of rank {victim.rank} took {seen:.1f} s to notice"
        assert left and left[-1][1].left == (victim.rank,)
        t0 = time.monotonic()
        with pytest.raises(RankUnavailable, match=f"rank {victim.rank}"):
            me.xcopy_sync(g[victim.rank], me.gva("dram", 0), 4096)
        assert time.monotonic() - t0 < 1.0  # fails fast, never hangs
        assert a.conn.poll(30)
        _, done, errors = a.conn.recv()
        assert done > 0 and errors == 0  # copies among the rest never stopped
        r = b.call("xcopy", g[victim.rank], g[b.rank], 4096)
        assert r[0] == "error" and r[1] == "RankUnavailable"
        b.ok("xcopy", g[a.rank] + 300000, g[b.rank] + 200000, 4096)
        got = _window(me, a.rank)[300000 : 300000 + 4096]
        np.testing.assert_array_equal(got, pattern(WIN, b.rank)[200000 : 200000 + 4096])
    finally:
        me.leave()
        for w in workers:
            w.stop()


def test_join_with_zero_windows_and_leave_hooks(server):
    w = _start(server.url, 1)[0]
    meta = Fabric.join(server.url, "sim", config=GvaConfig(node="elsewhere"))  # another node: maps nothing
    local = Fabric.join(server.url, "sim")
    try:
        local.wait_for(lambda t: len(t.members) == 3, 30)
        gw = local.gva("dram", 0, rank=w.rank)
        assert local.local_address(gw, 16) == local.resolve(gw, 16).ptr
        np.testing.assert_array_equal(local.resolve(gw, 64).buffer.numpy()[:64], pattern(WIN, w.rank)[:64])
        with pytest.raises(RankUnavailable, match="not mapped in this process"):
            meta.resolve(gw, 16)
        with pytest.raises(Exception, match="no transport can copy"):
            meta.xcopy_sync(gw, gw + 4096, 16)
        gone = []
        local.subscribe(lambda ch: gone.extend(ch.left))
        w.stop()
        local.wait_for(lambda t: w.rank not in t.ranks, 10)
        assert gone == [w.rank]
    finally:
        meta.leave()
        local.leave()


@pytest.mark.parametrize("spec", ["cuda-fake", "ascend-fake"])
def test_pool_on_the_device_platform_classes(server, spec):
    """The real CUDA / Ascend platform classes (on the host-memory runtime): device windows
    in three processes, copies H2D, D2D between processes, D2H, with directions inferred."""
    from platforms import build

    workers = _start(server.url, 2, {"hbm": WIN}, spec=spec)
    plat = build(spec)
    me = Fabric.join(server.url, plat, {"hbm": WIN})
    try:
        me.wait_for(lambda t: len(t.members) == 3, 30)
        a, b = workers
        for w in workers:  # b copies from this process's window: every rank must know it first
            w.ok("members", 3, 30)
        ga, gb, gm = (me.gva("hbm", 0, rank=r) for r in (a.rank, b.rank, me.rank))
        host = plat.alloc(WIN, "dram")
        host.numpy()[:] = pattern(WIN, 77)
        me.xcopy_sync(ga + 4096, host.at(0, 65536))  # H2D into rank a's device window
        b.ok("xcopy", gm + 100, ga + 4096, 65536)  # D2D, issued by a third process
        a.ok("batch", [(gb, gm + 100, 32768), (gb + 32768, ga + 4096 + 32768, 32768)])
        back = plat.alloc(WIN, "dram")
        h = me.batch_xcopy([(back.ptr, gb, 65536), (back.ptr + 65536, gb + 65536, 4096)])  # D2H
        assert (
            h.wait().tolist() == [ItemStatus.OK] * 2
        )  # no timeout: the fake runtime copies only when waited on
        np.testing.assert_array_equal(back.numpy()[:65536], host.numpy()[:65536])
        np.testing.assert_array_equal(
            back.numpy()[65536 : 65536 + 4096], pattern(WIN, b.rank)[65536 : 65536 + 4096]
        )
    finally:
        me.leave()
        plat.close()
        for w in workers:
            w.stop()
