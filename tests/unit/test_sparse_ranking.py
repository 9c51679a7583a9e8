"""GSA's ranking modes, the prompt-query window, layer allocation and the bound-first share.

The bound itself is tested in ``test_sparse_bound.py``; here: the ranking weights read the
same summary (``spread = residual = 1`` is the bound), every mode keeps the bound intact,
the selection helpers return what they promise, and the plugin decodes through the hooks
with each option (and tells which combinations it refuses)."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_llama import tiny_llama
from torch_threads import one_torch_thread  # noqa: F401

from kvfabric.harness.sparse.engine import PagedEngine
from kvfabric.ucm_layer.sparse.base import ModelSpec, create
from kvfabric.ucm_layer.sparse.blocksparse import recent_queries
from kvfabric.ucm_layer.sparse.gsa.plugin import GSA
from kvfabric.ucm_layer.sparse.gsa.summary import SvdMaxNormScorer
from kvfabric.ucm_layer.sparse.selection import SelectionConfig, select_blocks, top_free

BS = 8


def _keys(seed: int = 0, h: int = 2, n: int = 200, d: int = 32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(h, n, d, generator=gen) * torch.logspace(0.5, -0.5, d) + 0.7


def _block_max(q: torch.Tensor, keys: torch.Tensor, bs: int) -> torch.Tensor:
    s = torch.matmul(q.double(), keys.double().transpose(1, 2))
    pad = -s.shape[-1] % bs
    s = torch.nn.functional.pad(s, (0, pad), value=float("-inf"))
    return s.reshape(*s.shape[:2], -1, bs).amax(-1)


@pytest.mark.parametrize("select", ["bound", "estimate", "mixed"])
@pytest.mark.parametrize("basis", ["keys", "keys+queries"])
def test_every_ranking_mode_keeps_the_bound(select, basis):
    keys = _keys(1)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 3, 32, generator=gen) * 2
    prompt_q = torch.randn(2, 40, 32, generator=gen)
    s = SvdMaxNormScorer(2, 32, BS, rank=6, select=select, basis=basis, query_weight=0.25)
    s.fit(keys[:, :77], prompt_q)
    for t in range(77, 200, 5):  # decode-style appends across block edges
        s.append(keys[:, t : t + 5], t)
    assert int((s.bound(q).double() < _block_max(q, keys, BS)).sum()) == 0
    scores, priority = s.select_scores(q)
    assert scores.shape == (2, 25)
    assert (priority is not None) == (select == "mixed")
    assert s.priority_share == (0.5 if select == "mixed" else 0.0)


def test_estimate_reads_the_same_summary_and_is_the_bound_at_full_fractions():
    keys = _keys(3)
    q = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(4))
    full = SvdMaxNormScorer(2, 32, BS, rank=8, select="estimate", spread=1.0, residual=1.0)
    full.fit(keys)
    assert torch.allclose(full.block_scores(q), full.bound(q), rtol=1e-5, atol=1e-4)
    est = SvdMaxNormScorer(2, 32, BS, rank=8, select="estimate", spread=0.5, residual=0.25)
    est.fit(keys)
    assert est.numbers_per_block == full.numbers_per_block == 17
    # by hand: p.c + spread |p|.w + residual |q_res| R, with c, w the box's centre and half-width
    p = torch.matmul(q, est.basis)
    summ = est.summaries
    hi, neg_lo, r = summ[..., :8], summ[..., 8:16], summ[..., 16]
    c, w = (hi - neg_lo) / 2, (hi + neg_lo) / 2
    q_res = (q - torch.matmul(p, est.basis.transpose(1, 2))).norm(dim=-1, keepdim=True)
    expect = torch.matmul(p, c.transpose(1, 2)) + 0.5 * torch.matmul(p.abs(), w.transpose(1, 2))
    expect = expect + 0.25 * q_res * r.unsqueeze(1)
    assert torch.allclose(est.block_scores(q), expect, rtol=1e-4, atol=1e-4)
    # the combined scores are the group's summed softmax of the (scaled) estimate
    combined = torch.softmax(est.block_scores(q) / math.sqrt(32), dim=-1).sum(1)
    assert torch.allclose(est.scores(q), combined, atol=1e-5)


def test_scorer_options_are_checked():
    for bad in (
        {"select": "best"},
        {"spread": 1.5},
        {"residual": -0.1},
        {"query_weight": 2},
        {"bound_share": 0.0},
        {"bound_share": True},
    ):
        with pytest.raises(ValueError):
            SvdMaxNormScorer(2, 16, 8, rank=4, **bad)


def test_top_free_head_layer_and_priority():
    scores = torch.tensor([[9.0, 8, 7, 6, 5, 4], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]])
    head = top_free(scores, 2, SelectionConfig())
    assert sorted(head[0].tolist()) == [0, 1] and sorted(head[1].tolist()) == [4, 5]
    layer = top_free(scores, 2, SelectionConfig(allocation="layer", head_cap=2.0))
    assert layer.shape == (2, 4)  # up to head_cap x 2 per head
    assert sorted(x for x in layer[0].tolist() if x >= 0) == [0, 1, 2, 3]
    assert layer[1].tolist() == [-1] * 4  # the flat head gets nothing: 4 = 2 heads x 2 blocks
    capped = top_free(scores, 2, SelectionConfig(allocation="layer", head_cap=1.0))
    assert (capped >= 0).sum(1).tolist() == [2, 2]
    prio = torch.tensor([[0.0, 0, 0, 0, 0, 1], [1.0, 0, 0, 0, 0, 0]])
    mixed = top_free(scores, 2, SelectionConfig(), prio, 0.5)
    assert sorted(mixed[0].tolist()) == [0, 5] and sorted(mixed[1].tolist()) == [0, 5]
    table = select_blocks(
        torch.cat([torch.zeros(2, 1), scores, torch.zeros(2, 2)], 1), 9, 5, SelectionConfig()
    )
    assert table[:, 0].tolist() == [0, 0] and table[:, -2:].tolist() == [[7, 8], [7, 8]]
    with pytest.raises(ValueError, match="allocation"):
        SelectionConfig(allocation="global")
    with pytest.raises(ValueError, match="head_cap"):
        SelectionConfig(head_cap=0.5)


def test_recent_queries_window_and_uncaptured_tokens():
    q = torch.arange(10 * 4 * 2, dtype=torch.float32).reshape(10, 4, 2) + 1  # (T, Hq, D), Hkv = 2
    q[7] = 0  # a token whose queries were not captured
    out = recent_queries(q, 2, 4)  # tokens 6, 8, 9 (7 left out)
    assert out.shape == (2, 3 * 2, 2)
    assert torch.equal(out[0, :2], q[6, :2]) and torch.equal(out[1, -2:], q[9, 2:])
    assert recent_queries(q, 2, 0).shape == (2, 9 * 2, 2)


def _decode(plugin, model, prompt, steps=4):
    eng = PagedEngine(model, plugin, num_blocks=64, block_size=BS)
    out = eng.generate("r", prompt, steps)
    return out


def test_plugin_decodes_with_each_ranking_and_allocation():
    model = tiny_llama(seed=4)
    c = model.cfg
    spec = ModelSpec(c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, BS)
    prompt = torch.randint(0, 97, (100,), generator=torch.Generator().manual_seed(5)).tolist()
    # layer allocation: the kernel sees (H, c) tables whose unused entries have no tokens,
    # and the layer's heads together read at most H x the budget
    views = []

    class Seen(GSA):
        def attention_begin(self, layer, q, k, v, kv, attn, meta):
            super().attention_begin(layer, q, k, v, kv, attn, meta)
            views.append((attn.block_tables[0].clone(), attn.block_lens[0].clone()))

    shared = Seen(spec, {"budget_tokens": 40, "min_seq_len": 0, "allocation": "layer", "head_cap": 2.0})
    assert len(_decode(shared, model, prompt)) == 4
    sparse = [(t, ln) for t, ln in views if t.shape[0] == c.num_kv_heads]
    assert sparse
    for table, lens in sparse:
        assert int(lens.sum()) <= c.num_kv_heads * 40
        for h in range(c.num_kv_heads):
            used = table[h][lens[h] > 0].tolist()
            assert len(used) == len(set(used)) and len(used) >= 3  # forced sink + recent at least
    for opts in (
        {},
        {"select": "estimate", "spread": 0.25},
        {"basis": "keys+queries", "query_weight": 0.25, "query_window": 32},
        {"allocation": "layer", "head_cap": 1.5},
        {"select": "mixed", "bound_share": 0.25, "reuse_steps": 2},
    ):
        plugin = create("gsa", spec, {"budget_tokens": 40, "min_seq_len": 0, **opts})
        out = _decode(plugin, model, prompt)
        assert len(out) == 4 and plugin.stats()["sparse_layer_steps"] > 0
        assert 0.0 <= plugin.stats()["step_reuse"] <= 1.0
    with pytest.raises(ValueError, match="query_window"):
        create("gsa", spec, {"query_window": -1})
    with pytest.raises(ValueError, match="select"):
        create("gsa", spec, {"select": "nope"})
    with pytest.raises(ValueError, match="allocation"):
        create("gsa", spec, {"offload": True, "allocation": "layer", "budget_tokens": 40})
