"""One status vocabulary and one handle protocol: every asynchronous handle of kvfabric
(an xcopy's ``XferHandle``, the transports' completions, store tasks, the Delegator's
ops) is a ``kvfabric.status.Handle`` and behaves as its contract says, on real objects
(the sim platform's streams and shared memory, a posix store, an in-process fabric)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mem_store import MemStore
from stores import LAYOUT, Blocks, block_bytes, build_store, random_ids

from kvfabric.platform.types import Medium
from kvfabric.pool.gva.config import GvaConfig
from kvfabric.pool.gva.fabric import Fabric
from kvfabric.pool.gva.handle import ItemStatus as XcopyStatus
from kvfabric.pool.gva.rendezvous.server import RendezvousServer
from kvfabric.pool.gva.transports.base import DONE
from kvfabric.pool.gva.transports.mapped import EventCompletion
from kvfabric.pool.gva.transports.mooncake import MooncakeCompletion
from kvfabric.pool.status import Status
from kvfabric.status import (
    BLOCK_STATUSES,
    Handle,
    ItemStatus,
    counts,
    failed,
    finished,
    succeeded,
    wait_or_cancel,
)
from kvfabric.ucm_layer.delegator import Delegator
from kvfabric.ucm_layer.kv_layout import layout_from_tensors
from kvfabric.ucm_layer.store.base import BlockStatus


def _times_out_then_waits(h: Handle, release, n: int) -> np.ndarray:
    """The common behaviour: unfinished, ``wait`` times out and changes nothing, then (once
    ``release()`` lets the work go on) ``wait`` returns ``n`` final statuses."""
    assert isinstance(h, Handle)
    assert not h.check()
    with pytest.raises(TimeoutError):
        h.wait(0.02)
    assert not h.check()
    release()
    st = h.wait(30)
    assert st.dtype == np.int8 and st.shape == (n,) and finished(st).all()
    assert h.check()
    return st


def test_one_enum_with_one_value_per_meaning():
    assert Status is ItemStatus and BlockStatus is ItemStatus and XcopyStatus is ItemStatus
    assert ItemStatus.OK == 0
    assert Status.NOT_FOUND is ItemStatus.MISSING and Status.TRANSFER_FAILED is ItemStatus.FAILED
    values = [int(s) for s in ItemStatus]
    assert len(set(values)) == len(values) == len(ItemStatus) and sorted(values) == list(range(len(values)))
    assert set(BLOCK_STATUSES) <= set(ItemStatus) and ItemStatus.EXISTS not in BLOCK_STATUSES
    st = np.array([s for s in ItemStatus] + [120], np.int8)
    assert succeeded(st).tolist() == [s in (ItemStatus.OK, ItemStatus.EXISTS) for s in ItemStatus] + [False]
    fails = {ItemStatus.OK, ItemStatus.EXISTS, ItemStatus.MISSING, ItemStatus.PENDING}
    assert failed(st).tolist() == [s not in fails for s in ItemStatus] + [True]  # unknown: a failure
    assert finished(ItemStatus.CORRUPT) and not finished(ItemStatus.PENDING)
    assert (
        ItemStatus.TIMEOUT.is_failure and not ItemStatus.MISSING.is_failure and ItemStatus.EXISTS.is_success
    )
    assert counts(np.array([0, 0, 11], np.int8))[[ItemStatus.OK, ItemStatus.PENDING]].tolist() == [2, 1]


def test_transport_completions(plat):
    assert isinstance(DONE, Handle) and DONE.check() and DONE.wait(0).tolist() == [ItemStatus.OK]
    assert issubclass(MooncakeCompletion, Handle)  # needs an engine to make one (the remote tests)
    stream = plat.stream()
    plat.stall(stream, 0.2)
    ev = plat.event()
    ev.record(stream)
    comp = EventCompletion(ev, "a stalled copy")
    assert _times_out_then_waits(comp, stream.synchronize, 1).tolist() == [ItemStatus.OK]
    stream.close()


def test_xfer_handle():
    with RendezvousServer() as srv:
        fab = Fabric.join(srv.url, "sim", {"dram": 1 << 20}, config=GvaConfig(alignment=64, copy_streams=1))
        try:
            src = fab.platform.alloc(8192, "dram")
            src.numpy()[:] = 7
            mapped = fab._transports["mapped"]  # hold its one copy stream back for a while
            fab.platform.stall(mapped._streams[0], 0.2)
            g = fab.gva("dram", 0)
            h = fab.batch_xcopy([(g, src.ptr, 4096), (g + 4096, src.ptr + 4096, 4096)])
            st = _times_out_then_waits(h, lambda: None, 2)
            assert st.tolist() == [ItemStatus.OK] * 2 and h.ok
            assert h.wait() is st  # a finished handle returns the same array
            assert (fab.window("dram").numpy()[:8192] == 7).all()
            fab.platform.free(src)
        finally:
            fab.leave()


def test_store_tasks(plat, tmp_path):
    store = build_store("posix", tmp_path, plat)
    try:
        ids = random_ids(4, 3)
        src = Blocks(plat, LAYOUT, 4)
        src.write(block_bytes(ids, LAYOUT.shard_bytes))
        s = plat.stream()
        plat.stall(s, 0.2)
        ev = plat.event()
        ev.record(s)
        t = store.dump(ids, 0, src.addrs, after=ev)
        assert t.store is store
        assert (_times_out_then_waits(t, lambda: None, 4) == ItemStatus.OK).all()
        with pytest.raises(ValueError, match="already waited"):
            t.wait()
        plat.stall(s, 0.2)
        ev2 = plat.event()
        ev2.record(s)
        late = store.dump(random_ids(4, 4), 0, src.addrs, after=ev2)
        assert (wait_or_cancel(late, 0.02) == ItemStatus.TIMEOUT).all()  # the store API's wait
        s.close()
    finally:
        store.close()


def test_delegator_ops(plat):
    cache = {f"l{i}": torch.randn(2, 8, 4, 16) for i in range(2)}
    for t in cache.values():
        plat.wrap(t, Medium.HBM)
    lay = layout_from_tensors(cache, 8)
    store = MemStore(Delegator.store_layout(lay, True, False))
    d = Delegator(plat, lay, store, staging_blocks=4)
    ids = random_ids(3, 5)
    s = plat.stream()
    try:
        plat.stall(s, 0.2)
        ev = plat.event()
        ev.record(s)
        dump = d.dump(ids, [0, 1, 2], after=ev)
        assert (_times_out_then_waits(dump, lambda: None, 3) == ItemStatus.OK).all()
        # a load queued behind a dump held back by an event: cancelled at its deadline
        plat.stall(s, 0.3)
        ev = plat.event()
        ev.record(s)
        held = d.dump(random_ids(1, 6), [3], after=ev)
        load = d.load(ids, [4, 5, 6])
        with pytest.warns(DeprecationWarning, match="check"):
            assert not load.done()
        assert (wait_or_cancel(load, 0.02) == ItemStatus.TIMEOUT).all()
        with pytest.raises(ValueError, match="already waited"):
            load.wait()
        assert (held.wait(30) == ItemStatus.OK).all()
        assert (d.load(ids, [4, 5, 6]).wait(30) == ItemStatus.OK).all()
        assert torch.equal(cache["l1"][:, 4:7], cache["l1"][:, 0:3])
    finally:
        s.close()
        d.close()
        store.close()
