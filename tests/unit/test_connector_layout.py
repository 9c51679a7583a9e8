"""The layout seam: block ids cover the physical KV layout, the Delegator does not change
them, and pipeline parallelism is refused.

The KV tensors here are the ones vLLM's own allocation code builds
(``create_kv_cache_views`` over one flat buffer, for a resolved ``KVCacheLayout``), so
the configuration-side prediction (``compat.expected_kv_geometry``, what the scheduler
role derives the ids from) is checked against what a worker really gets. The store is
the real posix store in a temporary directory.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm.v1.kv_cache_layout")

from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvfabric.platform.registry import create
from kvfabric.ucm_layer import hashing
from kvfabric.ucm_layer.connector import compat, stores
from kvfabric.ucm_layer.connector.config import ConnectorConfig
from kvfabric.ucm_layer.connector.connector import _fingerprint, check_engine
from kvfabric.ucm_layer.connector.plan import StepPlan, Transfer
from kvfabric.ucm_layer.connector.views import EngineInfo
from kvfabric.ucm_layer.connector.worker import WorkerSide
from kvfabric.ucm_layer.kv_layout import layout_from_tensors

NB, L, BS, HEADS, HEAD = 16, 3, 16, 2, 32
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
INFO = EngineInfo("m", "torch.float32", BS, BS, NB, 1, False, True, True, {}, True)


@pytest.fixture
def plat():
    p = create("sim")
    yield p
    p.close()


def _engine(layout: KVCacheLayout, seed: int = 0):
    """(kv_cache_config, per-layer KV tensors as vLLM's workers get them, raw buffer)."""
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32)
    layer_stride, block_stride, *_ = compute_layout_strides(spec, NB, L, layout)
    tensor = KVCacheTensor(
        size=spec.page_size_bytes * NB * L, layers=NAMES, layer_stride=layer_stride, block_stride=block_stride
    )
    cfg = KVCacheConfig(
        num_blocks=NB,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(NAMES, spec)],
        kv_cache_layout=layout.name,
    )
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(-128, 127, (tensor.size,), dtype=torch.int8, generator=g)
    views = create_kv_cache_views(raw, spec, NB, layout, tensor)
    return cfg, dict(zip(NAMES, views)), raw


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte equality (random bytes seen as float32 hold NaNs, which never equal)."""
    return torch.equal(a.contiguous().view(torch.int8), b.contiguous().view(torch.int8))


def _expected(cfg: KVCacheConfig) -> str:
    geometry, name = compat.expected_kv_geometry(SimpleNamespace(cache_config=None), cfg)
    assert geometry is not None, name
    return layout_from_tensors(geometry, NB).signature


def _hasher(cfg: KVCacheConfig, **conf) -> hashing.BlockHasher:
    c = ConnectorConfig(store="posix", posix_path="/unused", **conf).resolved(True)
    return hashing.BlockHasher(_fingerprint(c, INFO, cfg, _expected(cfg)))


def _worker(plat, cfg: KVCacheConfig, path, **conf) -> WorkerSide:
    c = ConnectorConfig(store="posix", posix_path=str(path), **conf)
    return WorkerSide(
        c,
        plat,
        lambda layout: stores.acquire(c, plat, layout),
        expected_layout=_expected(cfg),
        layout_note=cfg.kv_cache_layout,
    )


def _close(*workers: WorkerSide) -> None:
    for w in workers:
        store = w.store
        w.close()
        if store is not None:
            stores.release(store)


ENGINE_HASHES = [bytes([i]) * 32 for i in range(4)]


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda lay: lay.name)
def test_the_configuration_predicts_the_tensors_vllm_allocates(layout):
    cfg, caches, _ = _engine(layout)
    assert layout_from_tensors(caches, NB).signature == _expected(cfg)


def test_layouts_that_store_other_bytes_get_other_ids_and_never_load_each_other(plat, tmp_path):
    """LBHNC (head-major block interiors, vLLM's CPU backend) and LBNHC (token-major, its
    CUDA default) with the same model, dtype and block size: the store would hold the same
    number of bytes in another order."""
    hm_cfg, hm_kv, _ = _engine(KVCacheLayout.LBHNC, seed=1)
    tm_cfg, tm_kv, tm_raw = _engine(KVCacheLayout.LBNHC, seed=2)
    assert _expected(hm_cfg) != _expected(tm_cfg)
    hm_ids = _hasher(hm_cfg).hash_engine(ENGINE_HASHES)
    tm_ids = _hasher(tm_cfg).hash_engine(ENGINE_HASHES)
    assert not (hm_ids == tm_ids).all(axis=1).any()

    writer, reader = _worker(plat, hm_cfg, tmp_path), _worker(plat, tm_cfg, tmp_path)
    writer.register(hm_kv, NB)
    reader.register(tm_kv, NB)
    writer.wait_for_save(StepPlan(dumps=[Transfer("w", hm_ids, np.arange(4))]))
    writer._reap(block=True)
    assert writer.stats.totals["saved_blocks"] == 4
    assert writer.store.lookup_prefix(hm_ids) == 4
    assert reader.store.lookup_prefix(tm_ids) == 0  # the other engine's ids are not there
    before = tm_raw.clone()
    reader.start_load(StepPlan(loads=[Transfer("r", tm_ids, np.arange(4, 8))]))
    assert reader.failed_blocks() == {4, 5, 6, 7}
    assert reader.stats.totals["load_failed_missing"] == 4
    assert torch.equal(tm_raw, before)  # not one byte came in
    _close(writer, reader)


def test_block_outer_and_layer_outer_layouts_store_the_same_bytes_and_share_blocks(plat, tmp_path):
    """BLHNC keeps all layers of a block together, LBHNC each layer apart, but a layer's
    page is the same [heads, tokens, head] run in both: same signature, same ids, a hit."""
    a_cfg, a_kv, _ = _engine(KVCacheLayout.BLHNC, seed=3)
    b_cfg, b_kv, _ = _engine(KVCacheLayout.LBHNC, seed=4)
    assert _expected(a_cfg) == _expected(b_cfg)
    ids = _hasher(a_cfg).hash_engine(ENGINE_HASHES)
    assert np.array_equal(ids, _hasher(b_cfg).hash_engine(ENGINE_HASHES))
    a, b = _worker(plat, a_cfg, tmp_path), _worker(plat, b_cfg, tmp_path)
    a.register(a_kv, NB)
    b.register(b_kv, NB)
    a.wait_for_save(StepPlan(dumps=[Transfer("w", ids, np.arange(4))]))
    a._reap(block=True)
    b.start_load(StepPlan(loads=[Transfer("r", ids, np.arange(8, 12))]))
    assert b.failed_blocks() == set()
    for n in NAMES:
        assert _same(b_kv[n][8:12], a_kv[n][0:4])
    _close(a, b)


def test_a_worker_handed_other_tensors_than_the_ids_promise_refuses_to_start(plat, tmp_path):
    cfg, _, _ = _engine(KVCacheLayout.LBHNC)
    _, other_kv, _ = _engine(KVCacheLayout.LBNHC)
    w = _worker(plat, cfg, tmp_path)
    with pytest.raises(ValueError, match=r"laid out as .*but the block ids were derived for.*LBHNC"):
        w.register(other_kv, NB)
    assert w.store is None  # refused before any store was opened
    assert not list(tmp_path.rglob("*[0-9a-f]" * 32))


def test_unpredictable_layout_is_named_once_and_not_refused(plat, tmp_path, caplog):
    cfg, kv, _ = _engine(KVCacheLayout.LBHNC)
    old = dataclasses.replace(cfg, kv_cache_layout=None)
    geometry, why = compat.expected_kv_geometry(SimpleNamespace(cache_config=None), old)
    assert geometry is None and "kv_cache_layout" in why
    c = ConnectorConfig(store="posix", posix_path=str(tmp_path))
    w = WorkerSide(c, plat, lambda lay: stores.acquire(c, plat, lay), layout_note=why)
    with caplog.at_level("WARNING", logger="kvfabric.connector"):
        w.register(kv, NB)
    assert [r for r in caplog.records if "do not cover the physical KV layout" in r.getMessage()]
    _close(w)


def test_the_delegator_switch_keeps_ids_and_bytes(plat, tmp_path):
    """Blocks dumped with the Delegator on load with it off (and the other way): the same
    ids, and the store holds the pieces in the same order either way."""
    cfg, src, _ = _engine(KVCacheLayout.LBHNC, seed=5)
    _, dst, _ = _engine(KVCacheLayout.LBHNC, seed=6)
    on, off = _hasher(cfg, delegator=True), _hasher(cfg, delegator=False)
    assert on.fingerprint == off.fingerprint
    ids = on.hash_engine(ENGINE_HASHES)
    assert np.array_equal(ids, off.hash_engine(ENGINE_HASHES))
    w_on = _worker(plat, cfg, tmp_path, delegator=True)
    w_off = _worker(plat, cfg, tmp_path, delegator=False)
    w_on.register(src, NB)
    w_off.register(dst, NB)
    assert w_on.store.layout != w_off.store.layout  # one piece per block vs one per layer
    w_on.wait_for_save(StepPlan(dumps=[Transfer("w", ids[:2], np.array([0, 1]))]))
    w_on._reap(block=True)
    w_off.wait_for_save(StepPlan(dumps=[Transfer("w", ids[2:], np.array([2, 3]))]))
    w_off._reap(block=True)
    w_off.start_load(StepPlan(loads=[Transfer("r", ids[:2], np.array([10, 11]))]))
    w_on.start_load(StepPlan(loads=[Transfer("r", ids[2:], np.array([12, 13]))]))
    assert w_off.failed_blocks() == set() and w_on.failed_blocks() == set()
    for n in NAMES:
        assert _same(dst[n][10:12], src[n][0:2])  # dumped on, loaded off
        assert _same(src[n][12:14], dst[n][2:4])  # dumped off, loaded on
    _close(w_on, w_off)


def test_layerwise_stays_in_the_ids():
    cfg, _, _ = _engine(KVCacheLayout.LBHNC)
    assert _hasher(cfg, layerwise=True).fingerprint != _hasher(cfg, layerwise=False).fingerprint


def test_pipeline_parallelism_is_refused_at_start_with_the_fix():
    check_engine(INFO)
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=2.*pipeline_parallel_size=1"):
        check_engine(dataclasses.replace(INFO, pp_size=2))
    with pytest.raises(ValueError, match="one KV cache group"):
        check_engine(dataclasses.replace(INFO, single_group=False))


def test_engine_info_reads_the_pipeline_stages():
    cfg, _, _ = _engine(KVCacheLayout.LBHNC)
    vcfg = SimpleNamespace(
        model_config=SimpleNamespace(model="m", dtype="float32", use_mla=False),
        cache_config=SimpleNamespace(block_size=BS),
        kv_transfer_config=SimpleNamespace(is_kv_producer=True, is_kv_consumer=True),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=4),
        device_config=SimpleNamespace(device_type="cpu"),
    )
    info = compat.engine_info(vcfg, cfg)
    assert info.pp_size == 4 and info.num_blocks == NB
    with pytest.raises(ValueError, match="pipeline_parallel_size=4"):
        check_engine(info)
