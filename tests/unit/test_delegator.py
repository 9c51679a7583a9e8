"""The Delegator: gather into staging slots, one store piece per block, scatter back."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mem_store import MemStore

from kvfabric.platform.types import Medium
from kvfabric.ucm_layer.delegator import Delegator
from kvfabric.ucm_layer.kv_layout import layout_from_tensors
from kvfabric.ucm_layer.store.base import BlockStatus

NB, L = 16, 6


def _cache(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"l{i}": torch.randn(2, NB, 8, 2, 16, generator=g) for i in range(L)}


def _setup(plat, caches, enabled=True, layerwise=False, staging=4):
    for t in caches.values():
        plat.wrap(t, Medium.HBM)
    lay = layout_from_tensors(caches, NB)
    store = MemStore(Delegator.store_layout(lay, enabled, layerwise))
    return (
        lay,
        store,
        Delegator(plat, lay, store, enabled=enabled, layerwise=layerwise, staging_blocks=staging),
    )


def _ids(n: int, salt: int = 0) -> np.ndarray:
    rng = np.random.default_rng(salt)
    return rng.integers(0, 256, (n, 16), dtype=np.uint8)


@pytest.mark.parametrize("enabled", [True, False])
def test_dump_then_load_round_trips_every_byte(plat, enabled):
    src, dst = _cache(1), {k: torch.zeros_like(v) for k, v in _cache(1).items()}
    _, store, d = _setup(plat, src, enabled)
    ids = _ids(10)
    blocks = np.array([3, 1, 4, 15, 9, 2, 6, 5, 8, 7])
    op = d.dump(ids, blocks)
    assert (op.wait() == BlockStatus.OK).all()
    assert op.released()
    # the mem store got one piece per block when the Delegator is on, 2 per layer when off
    assert store.pieces_copied == 10 * (1 if enabled else 2 * L)
    for t in dst.values():
        plat.wrap(t, Medium.HBM)
    lay2 = layout_from_tensors(dst, NB)
    d2 = Delegator(plat, lay2, store, enabled=enabled, staging_blocks=3)
    target = np.array([0, 11, 12, 13, 14, 10, 1, 2, 3, 4])
    assert (d2.load(ids, target).wait() == BlockStatus.OK).all()
    for name in src:
        assert torch.equal(dst[name][:, target], src[name][:, blocks])
    d.close(), d2.close(), store.close()


def test_failed_and_missing_blocks_are_reported_and_not_scattered(plat):
    src = _cache(2)
    _, store, d = _setup(plat, src)
    ids = _ids(3, 1)
    d.dump(ids[:2], [0, 1]).wait()
    before = {k: v.clone() for k, v in src.items()}
    st = d.load(ids, [5, 6, 7]).wait()
    assert list(st) == [BlockStatus.OK, BlockStatus.OK, BlockStatus.MISSING]
    assert torch.equal(src["l0"][:, 7], before["l0"][:, 7])
    store.fail_loads = True
    st = d.load(ids[:2], [8, 9]).wait()
    assert (st == BlockStatus.FAILED).all()
    assert torch.equal(src["l3"][:, 8:10], before["l3"][:, 8:10])
    d.close(), store.close()


def test_more_blocks_than_staging_slots_reuses_slots(plat):
    src = _cache(3)
    _, store, d = _setup(plat, src, staging=2)
    ops = [d.dump(_ids(5, s), np.arange(5) + s) for s in range(3)]  # 15 blocks, 2 slots
    for op in ops:
        assert (op.wait() == BlockStatus.OK).all()
    assert len(store.data) == 15
    with pytest.raises(ValueError, match="already waited"):
        ops[0].wait()
    d.close(), store.close()


def test_layerwise_shards_one_per_layer(plat):
    src, dst = _cache(4), {k: torch.zeros_like(v) for k, v in _cache(4).items()}
    _, store, d = _setup(plat, src, layerwise=True)
    assert store.layout.num_shards == L
    ids = _ids(4, 9)
    ops = [d.dump(ids, [0, 1, 2, 3], layer=layer) for layer in range(L)]
    assert all((op.wait() == BlockStatus.OK).all() for op in ops)
    assert store.lookup(ids).all()
    for t in dst.values():
        plat.wrap(t, Medium.HBM)
    d2 = Delegator(plat, layout_from_tensors(dst, NB), store, layerwise=True)
    loads = [d2.load(ids, [4, 5, 6, 7], layer=layer) for layer in range(L)]
    for layer, op in enumerate(loads):
        assert (op.wait() == BlockStatus.OK).all()
        assert torch.equal(dst[f"l{layer}"][:, 4:8], src[f"l{layer}"][:, 0:4])
    with pytest.raises(ValueError, match="layer-wise"):
        d2.load(ids, [0, 1, 2, 3])
    d.close(), d2.close(), store.close()


def test_dump_waits_for_the_compute_event(plat):
    src = _cache(5)
    _, store, d = _setup(plat, src)
    compute = plat.stream()
    plat.stall(compute, 0.2)
    ev = plat.event()
    ev.record(compute)
    src["l0"][:, 0] = 7.0  # written "by the kernel" before the event completes
    op = d.dump(_ids(1, 5), [0], after=ev)
    assert not op.released()  # the gather waits for the stalled compute stream
    assert (op.wait() == BlockStatus.OK).all() and op.released()
    d.close(), store.close()


def test_store_layout_mismatch_is_refused(plat):
    src = _cache(6)
    lay, store, d = _setup(plat, src, enabled=False)
    with pytest.raises(ValueError, match="needs StoreLayout"):
        Delegator(plat, lay, store, enabled=True)
    d.close(), store.close()
