"""Sim-only behaviour: fault injection, stalls, timeouts and the cost ledger."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvfabric.errors import OutOfSpace, TransferFailed
from kvfabric.platform.sim import CostModel, SimConfig, SimPlatform
from kvfabric.platform.types import CopyBatch, Direction, Medium


@pytest.fixture
def sim():
    p = SimPlatform()
    yield p
    p.close()


def test_failed_copy_can_tear_and_names_what_failed(sim):
    a, b = sim.alloc(1000, Medium.DRAM), sim.alloc(1000, Medium.HBM)
    a.numpy()[:] = 1
    sim.faults.fail_copy(nth=2, torn=True)
    sim.copy(b.at(0, 10), a.at(0, 10))  # first: fine
    with pytest.raises(TransferFailed, match="H2D of 1000 B"):
        sim.copy(b, a)
    assert b.numpy()[:500].all() and not b.numpy()[500:].any()  # half written
    sim.copy(b, a)  # the fault fired once
    assert b.numpy().all()
    assert sim.faults.copies_failed == 1


def test_failed_batch_reports_pieces(sim):
    a, b = sim.alloc(4096, Medium.DRAM), sim.alloc(4096, Medium.HBM)
    sim.faults.fail_copy(torn=False)
    with pytest.raises(TransferFailed, match="batch copy of 4 pieces"):
        sim.batch_copy(CopyBatch.from_items([(b.ptr + i * 100, a.ptr, 50) for i in range(4)]))


def test_allocation_cap(sim):
    sim.faults.cap_alloc(10_000)
    a = sim.alloc(6000, Medium.HBM)
    with pytest.raises(OutOfSpace, match="6000 B of a 10000 B cap"):
        sim.alloc(6000, Medium.HBM)
    sim.free(a)
    sim.alloc(6000, Medium.HBM, shareable=True)
    assert sim.owned_bytes == 6000
    cfg = SimPlatform(config=SimConfig(alloc_cap=100))
    with pytest.raises(OutOfSpace):
        cfg.alloc(101)
    cfg.close()


def test_stall_timeout_and_cross_stream_order(sim):
    n = 1 << 20
    a, b, c = sim.alloc(n, Medium.DRAM), sim.alloc(n, Medium.HBM), sim.alloc(n, Medium.DRAM)
    a.numpy()[:] = 3
    s1, s2, ev = sim.stream(), sim.stream(), sim.event()
    sim.stall(s1, 0.3)
    sim.copy(b, a, stream=s1)
    ev.record(s1)
    s2.wait_event(ev)
    sim.copy(c, b, stream=s2)
    assert not s1.query() and not ev.query()
    with pytest.raises(TimeoutError):
        s2.synchronize(timeout=0.01)
    with pytest.raises(TimeoutError):
        ev.synchronize(timeout=0.01)
    s2.synchronize(timeout=10)
    assert (c.numpy() == 3).all()  # s2 really waited for s1's copy behind the stall
    with pytest.raises(ValueError, match="seconds"):
        sim.stall(s1, -1)


def test_event_after_failed_copy_reports_it(sim):
    a, b = sim.alloc(64, Medium.DRAM), sim.alloc(64, Medium.HBM)
    s, ev = sim.stream(), sim.event()
    sim.faults.fail_copy()
    sim.copy(b, a, stream=s)
    ev.record(s)
    with pytest.raises(TransferFailed):
        ev.synchronize()
    with pytest.raises(TransferFailed):
        s.synchronize()
    s.synchronize()


def test_ledger_prices_batches_below_single_copies():
    model = CostModel.preset("cuda-h100")
    sim = SimPlatform(config=SimConfig(cost_model=model))
    a, b = sim.alloc(1 << 20, Medium.DRAM), sim.alloc(1 << 20, Medium.HBM)
    for i in range(16):
        sim.copy(b.at(i * 4096, 4096), a.at(i * 4096, 4096))
    (single,) = sim.ledger.totals()
    sim.ledger.reset()
    sim.batch_copy(CopyBatch.from_items([(b.ptr + i * 4096, a.ptr + i * 4096, 4096) for i in range(16)]))
    (batched,) = sim.ledger.totals()
    assert single.direction is batched.direction is Direction.H2D
    assert single.nbytes == batched.nbytes == 16 * 4096
    assert batched.sim_s < single.sim_s / 4
    assert single.sim_s == pytest.approx(16 * model.copy_seconds(Direction.H2D, 4096))
    sim.close()


def test_streams_overlap_with_the_caller(sim):
    a, b = sim.alloc(1 << 20, Medium.DRAM), sim.alloc(1 << 20, Medium.HBM)
    s = sim.stream()
    sim.stall(s, 0.2)
    t0 = time.perf_counter()
    sim.copy(b, a, stream=s)
    assert time.perf_counter() - t0 < 0.15  # queued, not run inline
    s.synchronize()
    assert np.array_equal(a.numpy(), b.numpy())
