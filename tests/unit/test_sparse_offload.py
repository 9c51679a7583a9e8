"""GSA with offload: unselected blocks live in a store (a stateful in-memory one here),
selections are prefetched one step ahead, and the decode is the same as without offload."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mem_store import MemStore
from tiny_llama import tiny_llama
from torch_threads import one_torch_thread  # noqa: F401

from kvfabric.errors import TransferFailed
from kvfabric.harness.sparse.engine import PagedEngine
from kvfabric.platform.api import create as create_platform
from kvfabric.ucm_layer.sparse.base import ModelSpec, create
from kvfabric.ucm_layer.sparse.gsa.offload import block_ids, request_key, store_layout

BS = 8
CFG = {"budget_tokens": 48, "min_seq_len": 0, "sink_blocks": 1, "recent_blocks": 2, "select_ahead": True}


def _spec(model):
    c = model.cfg
    return ModelSpec(c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, BS)


def _store(kind, layout, plat, tmp_path):
    if kind == "mem":
        return MemStore(layout, plat)
    from kvfabric.ucm_layer.store import create as create_store

    cfg = {"cache.capacity": "16MiB", "posix.dirs": [str(tmp_path / "kv")]}
    return create_store(
        kind, {k: v for k, v in cfg.items() if k.split(".")[0] in kind}, layout=layout, platform=plat
    )


@pytest.fixture(params=["mem"])
def env(request, tmp_path):
    plat = create_platform("sim")
    model = tiny_llama(seed=11)
    store = _store(request.param, store_layout(BS, model.cfg.head_dim, 4), plat, tmp_path)
    yield plat, model, store
    store.close()
    plat.close()


def _decode(model, plugin, prompt, steps, nblocks=64):
    eng = PagedEngine(model, plugin, num_blocks=nblocks, block_size=BS)
    logits = [eng.add_request("r", prompt)]
    toks = []
    for _ in range(steps):
        toks.append(int(logits[-1].argmax()))
        logits.append(eng.decode(["r"], [toks[-1]])[0])
    used = len(eng.requests["r"].blocks)
    eng.finish("r")
    return toks, torch.stack(logits), used


@pytest.mark.parametrize("env", ["mem", "cache", "posix", "cache|posix"], indirect=True)
def test_offloaded_decode_equals_resident_decode(env):
    plat, model, store = env
    prompt = torch.randint(0, 97, (300,), generator=torch.Generator().manual_seed(12)).tolist()
    ref_toks, ref_logits, ref_used = _decode(model, create("gsa", _spec(model), CFG), prompt, 20)
    off = create("gsa", _spec(model), {**CFG, "offload": True}, store=store, platform=plat)
    toks, logits, used = _decode(model, off, prompt, 20)
    assert toks == ref_toks
    assert torch.allclose(logits, ref_logits, atol=1e-4)
    st = off.stats()
    assert used == 1 + 2 + 6 < ref_used  # sink + ring + cache (2 x 3 free) instead of every block
    assert st["dumped_blocks"] > 0 and st["h2d_bytes"] > 0
    assert st["prefetched_blocks"] > 0 and st["prefetch_hits"] > 0
    assert st["demand_blocks"] > 0  # the first sparse step has nothing prefetched
    assert 0.0 <= st["step_reuse"] <= 1.0
    # every complete block of every (layer, head) reached the store
    full = (300 + 20) // BS  # complete blocks at the end
    heads, blocks = np.divmod(np.arange(2 * (full - 1)), full - 1)
    for layer in range(2):
        ids = block_ids(request_key("r"), layer, heads, blocks + 1)
        assert store.lookup(ids).all()
    assert not store.lookup(block_ids(request_key("r"), 0, np.array([0]), np.array([full]))).any()

    off.close()


def test_failed_demand_load_raises_transfer_failed(env):
    plat, model, store = env
    prompt = torch.randint(0, 97, (300,), generator=torch.Generator().manual_seed(13)).tolist()
    off = create("gsa", _spec(model), {**CFG, "offload": True}, store=store, platform=plat)
    eng = PagedEngine(model, off, num_blocks=64, block_size=BS)
    eng.add_request("r", prompt)
    store.fail_next_loads = 1000
    with pytest.raises(TransferFailed, match="demand load"):
        eng.decode(["r"], [1])
    eng.finish("r")
    off.close()


def test_offload_configuration_errors(env):
    plat, model, store = env
    with pytest.raises(ValueError, match="needs a store"):
        create("gsa", _spec(model), {**CFG, "offload": True})
    with pytest.raises(ValueError, match="absolute budget"):
        create("gsa", _spec(model), {"budget_fraction": 0.1, "offload": True}, store=store, platform=plat)
    with pytest.raises(ValueError, match="dense_layers"):
        create("gsa", _spec(model), {**CFG, "offload": True, "dense_layers": [0]}, store=store, platform=plat)
    with pytest.raises(ValueError, match="cache_blocks"):
        create("gsa", _spec(model), {**CFG, "offload": True, "cache_blocks": 1}, store=store, platform=plat)
