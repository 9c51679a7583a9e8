"""xcopy in one process: bad input is refused before anything is written; handles; etcd pools."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
from etcd_server import etcd_binary, etcd_server
from gva_worker import Worker
from kvf_testing import segments

from kvfabric.errors import RankUnavailable, StaleSegmentTable, TransferFailed
from kvfabric.platform.types import CopyBatch, Medium
from kvfabric.pool.gva import membership
from kvfabric.pool.gva.address import GVA_END
from kvfabric.pool.gva.config import GvaConfig
from kvfabric.pool.gva.fabric import Fabric, FabricState
from kvfabric.pool.gva.handle import ItemStatus
from kvfabric.pool.gva.rendezvous import connect
from kvfabric.pool.gva.rendezvous.server import RendezvousServer

WIN = 1 << 20


@pytest.fixture
def pool():
    with RendezvousServer() as srv:
        cfg = GvaConfig(alignment=64)
        a = Fabric.join(srv.url, "sim", {"dram": WIN, "hbm": WIN}, config=cfg)
        b = Fabric.join(srv.url, "sim", {"dram": WIN}, config=cfg)
        a.wait_for(lambda t: len(t.members) == 2, 10)
        try:
            yield srv, a, b
        finally:
            b.leave()
            a.leave()


def test_bad_input_gets_a_clear_error_and_writes_nothing(pool):
    _srv, a, b = pool
    dst = b.window("dram").numpy()
    dst[:] = 0xEE
    src = a.platform.alloc(64 << 10, "dram")
    src.numpy()[:] = 1
    gb = a.gva("dram", 0, rank=b.rank)
    good = (gb, src.ptr, 4096)
    cases = [
        ((gb + 3, src.ptr, 4096), ValueError, "aligned"),
        ((gb, src.ptr, 100), ValueError, "aligned"),
        ((gb + WIN + 64, src.ptr, 64), ValueError, "outside the window"),
        ((gb + WIN - 64, src.ptr, 128), ValueError, "crosses the end"),
        ((GVA_END + 64, src.ptr, 64), ValueError, "neither a local address nor a GVA"),
        ((gb, 0x1000, 64), ValueError, "not inside any live buffer"),
        ((gb + (8 << 20), src.ptr, 64), RankUnavailable, "not a member"),
    ]
    for bad, exc, match in cases:
        with pytest.raises(exc, match=match):
            a.batch_xcopy_sync([good, good, bad])  # valid items first: still nothing is written
        assert (dst == 0xEE).all(), f"{bad} wrote bytes before failing"
    for n in (0, -64):
        with pytest.raises(ValueError, match=r"nbytes must be > 0"):
            a.xcopy_sync(gb, src.ptr, n)
        with pytest.raises(ValueError):
            a.batch_xcopy_sync([good, (gb, src.ptr, n)])
    with pytest.raises(TypeError):
        a.xcopy_sync("gva", src, 64)
    with pytest.raises(ValueError, match="do not fit"):
        a.xcopy_sync(gb, src.at(0, 64), 128)
    with pytest.raises(ValueError, match="aligned"):
        a.xcopy_sync(gb, src.at(3, 64), 64)  # a local end must be aligned too
    with pytest.raises(ValueError, match="aligned"):
        a.xcopy_sync(gb + 64, gb + 3, 64)  # unaligned GVA source
    assert (dst == 0xEE).all()
    a.xcopy_sync(gb, src, 4096)
    assert (dst[:4096] == 1).all() and (dst[4096:] == 0xEE).all()


def test_stale_table_version_is_refused(pool):
    srv, a, b = pool
    v = a.version
    gb = a.gva("dram", 128, rank=b.rank)
    a.xcopy_sync(gb, a.gva("hbm", 0), 64, version=v)
    rank_b = b.rank
    b.leave()
    c = Fabric.join(srv.url, "sim", {"dram": WIN}, rank=rank_b, config=GvaConfig(alignment=64))
    try:
        a.wait_for(lambda t: rank_b in t.ranks, 10)
        assert a.gva("dram", 128, rank=rank_b) == gb  # the same number, a new window
        c.window("dram").numpy()[:] = 0xEE
        with pytest.raises(StaleSegmentTable, match=f"rank {rank_b} rejoined"):
            a.xcopy_sync(gb, a.gva("hbm", 0), 64, version=v)
        with pytest.raises(StaleSegmentTable, match="rejoined"):
            a.batch_xcopy_sync(
                [(a.gva("hbm", 64), a.gva("hbm", 0), 64), (gb, a.gva("hbm", 0), 64)], version=v
            )
        with pytest.raises(StaleSegmentTable, match="holds"):
            a.xcopy_sync(gb, a.gva("hbm", 0), 64, version=a.version + 5)
        assert (c.window("dram").numpy() == 0xEE).all()
        a.xcopy_sync(gb, a.gva("hbm", 0), 64, version=a.version)
    finally:
        c.leave()


def test_async_handles_report_per_item_status(pool):
    _srv, a, b = pool
    src = a.platform.alloc(WIN, "dram")
    src.numpy()[:] = np.arange(WIN, dtype=np.uint64).astype(np.uint8)
    gb = a.gva("dram", 0, rank=b.rank)
    ga = a.gva("hbm", 0)
    items = CopyBatch(
        np.array([gb, ga, gb + 65536], np.uint64),
        np.array([src.ptr, src.ptr + 4096, ga], np.uint64),
        np.array([4096, 8192, 4096], np.uint64),
    )
    h = a.batch_xcopy(items)
    st = h.wait(10)
    assert h.check() and h.ok and st.tolist() == [ItemStatus.OK] * 3
    assert (b.window("dram").numpy()[:4096] == src.numpy()[:4096]).all()
    assert (b.window("dram").numpy()[65536 : 65536 + 4096] == src.numpy()[4096:8192]).all()
    # a failing copy (injected in the platform) fails its group only, with the reason
    a.platform.faults.fail_copy(nth=1, count=1, torn=False)
    h = a.batch_xcopy([(gb, src.ptr, 4096)])
    h.wait(10)
    assert h.status.tolist() == [ItemStatus.FAILED] and not h.ok
    with pytest.raises(TransferFailed, match="1 of 1 xcopy item"):
        h.raise_for_status()


def test_fast_path_and_windows(pool):
    _srv, a, b = pool
    g = a.gva("dram", 4096, rank=b.rank)
    span = a.resolve(g, 65536)
    assert span.ptr == a.local_address(g, 65536) and span.nbytes == 65536
    span.buffer.numpy()[span.offset : span.offset + 4] = [1, 2, 3, 4]
    assert b.window("dram").numpy()[4096:4100].tolist() == [1, 2, 3, 4]
    for bad in ((g, 0), (g + WIN, 64), (g, WIN)):
        with pytest.raises(ValueError):
            a.resolve(*bad)
    with pytest.raises(ValueError, match="contributes no hbm"):
        b.window("hbm")
    assert a.table.segment(Medium.HBM, a.rank).nbytes == WIN


def test_pool_over_etcd_notices_a_killed_rank():
    if etcd_binary() is None:
        pytest.skip("etcd binary not found: install Debian's etcd-server (.ci/run does)")
    with etcd_server() as url:
        cfg = {"heartbeat_ttl": 2.0}
        w = Worker.start(url, {"dram": WIN}, **cfg)
        me = Fabric.join(url, "sim", {"dram": WIN}, config=GvaConfig(heartbeat_ttl=2.0))
        try:
            me.wait_for(lambda t: len(t.members) == 2, 20)
            gw = me.gva("dram", 0, rank=w.rank)
            me.xcopy_sync(gw, me.gva("dram", 0), 4096)
            os.kill(w.proc.pid, signal.SIGKILL)
            t0 = time.monotonic()
            me.wait_for(lambda t: w.rank not in t.ranks, 15)
            assert time.monotonic() - t0 < 2.0 + 4.0  # lease ttl plus a few seconds
            with pytest.raises(RankUnavailable):
                me.xcopy_sync(gw, me.gva("dram", 0), 4096)
            assert me.state is FabricState.JOINED
        finally:
            me.leave()
            w.stop()


def test_a_failed_join_leaves_nothing_behind(pool, isolated_shm):
    srv, a, b = pool
    before = segments(isolated_shm)
    with pytest.raises(ValueError, match="already held"):
        Fabric.join(srv.url, "sim", {"dram": WIN}, rank=b.rank)
    with pytest.raises(ValueError, match="must be an int > 0"):
        Fabric.join(srv.url, "sim", {"dram": 0})
    assert segments(isolated_shm) == before  # the windows it allocated were freed
    with connect(srv.url) as s:
        alive = s.range(membership.alive_prefix(a.config.namespace))[0]
    assert len(alive) == 2 and sorted(m.token for m in a.table.members) == sorted([a.token, b.token])


def test_concurrent_joins_get_distinct_ranks_and_one_table():
    import threading

    with RendezvousServer() as srv:
        fabs: list[Fabric] = []
        lock = threading.Lock()

        def join():
            f = Fabric.join(srv.url, "sim", {"dram": 1 << 20})
            with lock:
                fabs.append(f)

        ts = [threading.Thread(target=join) for _ in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        try:
            assert sorted(f.rank for f in fabs) == [0, 1, 2, 3]
            tables = [f.wait_for(lambda t: len(t.members) == 4, 10) for f in fabs]
            assert all(t == tables[0] for t in tables) and tables[0].version == 4
        finally:
            for f in fabs:
                f.leave()


def test_losing_the_rendezvous_store_evicts_the_rank():
    srv = RendezvousServer().start()
    a = Fabric.join(srv.url, "sim", {"dram": 1 << 20})
    try:
        srv.close()
        deadline = time.monotonic() + 10
        while a.state is FabricState.JOINED and time.monotonic() < deadline:
            time.sleep(0.05)
        assert a.state is FabricState.EVICTED
        with pytest.raises(RankUnavailable, match="session lost"):
            a.xcopy_sync(a.gva("dram", 0), a.gva("dram", 4096), 64)
    finally:
        a.leave()


def test_a_departed_window_is_unmapped_after_its_grace_and_not_under_a_copy():
    from kvfabric.platform.types import BufferKind

    with RendezvousServer() as srv:
        a = Fabric.join(srv.url, "sim", {"dram": WIN}, config=GvaConfig(unmap_grace=2.0))
        b = Fabric.join(srv.url, "sim", {"dram": WIN})
        try:
            a.wait_for(lambda t: len(t.members) == 2, 10)
            imported = [x for x in a.platform.buffers() if x.kind is BufferKind.IMPORTED]
            assert len(imported) == 1
            span = a.resolve(a.gva("dram", 0, rank=b.rank), 64)
            b.leave()
            a.wait_for(lambda t: len(t.members) == 1, 10)
            span.buffer.numpy()[:64] = 7  # still mapped during the grace period
            deadline = time.monotonic() + 10
            while not imported[0].freed and time.monotonic() < deadline:
                time.sleep(0.05)
            assert imported[0].freed
        finally:
            a.leave()
