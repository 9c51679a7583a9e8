"""Repair at the worker: a request whose load failed computed this step's KV on top of
the failed blocks, so its dumps are skipped until a plan names it repaired.

Planted fault: the store reports the first block of the load ``CORRUPT`` (and writes
flipped bytes into the destination, as a bad copy would); the check is which ids the
store holds afterwards.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mem_store import MemStore

from kvfabric.ucm_layer import hashing
from kvfabric.ucm_layer.connector.config import ConnectorConfig
from kvfabric.ucm_layer.connector.plan import StepPlan, Transfer
from kvfabric.ucm_layer.connector.worker import WorkerSide

NB, L = 12, 3


def _present(store: MemStore, ids: np.ndarray) -> list[bool]:
    return [bool(x) for x in store.lookup(hashing.tag(ids, 0, 0))]


@pytest.mark.parametrize("layerwise", [False, True])
def test_dumps_of_a_request_whose_load_failed_wait_for_its_repair(plat, layerwise):
    stores: dict = {}

    def factory(layout):
        return stores.setdefault(layout, MemStore(layout))

    w = WorkerSide(ConnectorConfig(store="posix", posix_path="/unused", layerwise=layerwise), plat, factory)
    g = torch.Generator().manual_seed(3)
    big = torch.randn(L, NB, 2, 8, 16, generator=g)
    caches = {f"model.layers.{i}.attn": big[i] for i in range(L)}
    w.register(caches, NB)
    (store,) = stores.values()
    rng = np.random.default_rng(7)
    prefix, computed, other = (rng.integers(0, 256, (n, 16), dtype=np.uint8) for n in (2, 1, 1))

    def step(plan: StepPlan) -> None:
        """The hooks in vLLM's order: a step without loads starts them after the forward."""
        if plan.loads:
            w.start_load(plan)
        for name in caches:
            w.wait_layer(name)
            w.save_layer(name, plan)
        if not plan.loads:
            w.start_load(plan)
        w.wait_for_save(plan)
        w._reap(block=True)

    step(StepPlan(dumps=[Transfer("cold", prefix, np.array([0, 1]))]))
    assert _present(store, prefix) == [True, True]

    # warm loads the prefix into blocks 4, 5 (block 4 fails) and computes block 6 on it;
    # "shared" starts on block 4 too (vLLM's prefix cache) and computes block 8; "x" reads
    # nothing loaded and computes block 7: only its dump is stored
    shared = rng.integers(0, 256, (1, 16), dtype=np.uint8)
    store.corrupt_next_loads = 1
    step(
        StepPlan(
            loads=[Transfer("warm", prefix, np.array([4, 5]))],
            dumps=[
                Transfer("warm", computed, np.array([6])),
                Transfer("x", other, np.array([7])),
                Transfer("shared", shared, np.array([8])),
            ],
            readers={"warm": {4, 5}, "shared": {4}},
        )
    )
    assert w.failed_blocks() == {4}
    assert _present(store, computed) == [False]  # not stored: computed on top of block 4
    assert _present(store, shared) == [False]
    assert _present(store, other) == [True]
    step(StepPlan(dumps=[Transfer("warm", computed, np.array([6]))]))  # not repaired yet
    assert _present(store, computed) == [False]

    # the scheduler set "warm" back; vLLM recomputed it from block 4: dumps land again
    step(
        StepPlan(
            dumps=[Transfer("warm", np.concatenate([prefix[:1], computed]), np.array([4, 6]))],
            repaired={"warm"},
        )
    )
    assert _present(store, computed) == [True]
    assert w.failed_blocks() == set()
    w.close()
