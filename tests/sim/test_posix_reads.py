"""The posix store's read path: timeouts mid-read, scatter reads straight into host memory."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
from store_faults import SlowReadIO
from stores import LAYOUT, Blocks, block_bytes, dump_blocks, random_ids

from kvfabric.platform.sim import SimPlatform
from kvfabric.platform.types import Medium
from kvfabric.ucm_layer.store.base import BlockStatus
from kvfabric.ucm_layer.store.posix import PosixConfig, PosixStore
from kvfabric.ucm_layer.store.posix_files import FileIO

OK, TIMEOUT = int(BlockStatus.OK), int(BlockStatus.TIMEOUT)


@pytest.fixture
def plat():
    p = SimPlatform()
    yield p
    p.close()


def posix(tmp_path, plat, **cfg):
    conf = {"dirs": (str(tmp_path / "d0"),), "io_threads": 2, **cfg}
    return PosixStore(PosixConfig(**conf), platform=plat, layout=LAYOUT)


def release_after_cancel(task, slow):
    """Let the stalled reads go only once ``task`` has been cancelled (by a timeout)."""

    def run():
        while task.cancelled is None:
            time.sleep(0.005)
        time.sleep(0.05)
        slow.release.set()

    threading.Thread(target=run, daemon=True).start()


def test_load_timeout_reading_straight_into_host_memory(tmp_path, plat):
    """Reading into contiguous host memory is itself the access to the caller's memory: a
    timeout waits for the read already running (block 0), and no later one starts."""
    s = posix(tmp_path, plat, io_threads=1)
    ids = random_ids(4, 9)
    assert (dump_blocks(s, plat, ids) == OK).all()
    slow = SlowReadIO()
    s.io = slow
    dst = Blocks(plat, LAYOUT, 4, Medium.DRAM, contiguous=True)
    t = s.load(ids, 0, dst.addrs)
    slow.started.wait(10)
    release_after_cancel(t, slow)
    st = s.wait(t, timeout=0.02)
    assert st.tolist() == [OK, TIMEOUT, TIMEOUT, TIMEOUT]
    time.sleep(0.3)
    assert np.array_equal(dst.read()[0], block_bytes(ids[:1], LAYOUT.shard_bytes)[0])
    assert all(dst.untouched(i) for i in range(1, 4))
    s.close()


def test_load_timeout_on_the_bounce_path(tmp_path, plat):
    s = posix(tmp_path, plat, io_threads=1)
    ids = random_ids(4, 10)
    assert (dump_blocks(s, plat, ids) == OK).all()
    slow = SlowReadIO()
    s.io = slow
    dst = Blocks(plat, LAYOUT, 4)
    t = s.load(ids, 0, dst.addrs)
    slow.started.wait(10)
    release_after_cancel(t, slow)
    assert (s.wait(t, timeout=0.02) == TIMEOUT).all()
    time.sleep(0.4)  # the reads finished meanwhile; their bytes stayed in the bounce area
    assert all(dst.untouched(i) for i in range(4))
    s.close()


class ShortReadIO(FileIO):
    """Real files, but every ``preadv`` returns at most 1000 bytes (as a signal may)."""

    def read_scatter(self, fd, views, offset):
        real = os.preadv

        def short(fd_, bufs, pos):
            budget, cut = 1000, []
            for b in bufs:
                if budget <= 0:
                    break
                cut.append(b[:budget])
                budget -= len(cut[-1])
            return real(fd_, cut, pos)

        os.preadv = short
        try:
            super().read_scatter(fd, views, offset)
        finally:
            os.preadv = real


@pytest.mark.parametrize("io", [FileIO, ShortReadIO], ids=["preadv", "short-reads"])
def test_loads_into_host_pieces_read_straight_into_them(tmp_path, plat, io):
    """Host (DRAM) destinations are filled by a scatter read per block, with no bounce
    buffer and no platform copy; device destinations keep the bounce path."""
    store = posix(tmp_path, plat)
    store.io = io()
    ids = random_ids(6, 77)
    assert (dump_blocks(store, plat, ids) == OK).all()
    host = Blocks(plat, LAYOUT, 6, medium=Medium.DRAM)
    plat.ledger.reset()
    assert (store.wait(store.load(ids, 0, host.addrs)) == OK).all()
    assert plat.ledger.totals() == []  # no bounce copy: the file went straight into the pieces
    assert np.array_equal(host.read(), block_bytes(ids, LAYOUT.shard_bytes))
    device = Blocks(plat, LAYOUT, 6)
    plat.ledger.reset()
    assert (store.wait(store.load(ids, 0, device.addrs)) == OK).all()
    assert plat.ledger.totals()  # device memory: bounce buffer and a batched copy
    assert np.array_equal(device.read(), block_bytes(ids, LAYOUT.shard_bytes))
    store.close()
