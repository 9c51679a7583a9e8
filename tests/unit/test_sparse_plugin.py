"""The sparse hooks driven by the paged engine on a tiny random Llama: call order,
replaced and restored block tables, the adaptive switch, reuse, configuration errors."""

from __future__ import annotations

import re

import pytest
import torch
from tiny_llama import tiny_llama
from torch_threads import one_torch_thread  # noqa: F401

from kvfabric.harness.sparse.engine import PagedEngine
from kvfabric.ucm_layer.sparse import base
from kvfabric.ucm_layer.sparse.base import AttnMode, ModelSpec, StepBatch, create
from kvfabric.ucm_layer.sparse.gsa.plugin import GSA
from kvfabric.ucm_layer.sparse.gsa.policy import BlockSparseConfig, decide_modes, skipped_kv, worth_sparse

BS = 8


def _spec(model):
    c = model.cfg
    return ModelSpec(c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, BS)


class Recording(GSA):
    """GSA that records the hooks it sees and checks what the kernel will read."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls: list[str] = []
        self.views: list[tuple[torch.Tensor, torch.Tensor, int]] = []

    def request_begin(self, rid, n):
        self.calls.append("request_begin")
        super().request_begin(rid, n)

    def estimate_num_slots(self, rid, n):
        self.calls.append("estimate_num_slots")
        return super().estimate_num_slots(rid, n)

    def build_sparse_meta(self, batch, attn):
        self.calls.append("build_sparse_meta")
        return super().build_sparse_meta(batch, attn)

    def attention_begin(self, layer, q, k, v, kv, attn, meta):
        self.calls.append(f"attention_begin:{layer}")
        self.originals = [t.clone() for t in attn.block_tables]
        super().attention_begin(layer, q, k, v, kv, attn, meta)
        self.views.append((attn.block_tables[0].clone(), attn.block_lens[0].clone(), attn.seq_lens[0]))

    def attention_finished(self, layer, q, k, v, out, kv, attn, meta):
        self.calls.append(f"attention_finished:{layer}")
        super().attention_finished(layer, q, k, v, out, kv, attn, meta)
        assert not attn.saved
        assert all(torch.equal(a, b) for a, b in zip(attn.block_tables, self.originals))

    def execute_finished(self, meta):
        self.calls.append("execute_finished")

    def request_finished(self, rid):
        self.calls.append("request_finished")
        super().request_finished(rid)


def _run(model, plugin, prompt, steps=6, nblocks=64):
    eng = PagedEngine(model, plugin, num_blocks=nblocks, block_size=BS)
    return eng.generate("r", prompt, steps), eng


def test_full_budget_is_dense_and_hooks_run_in_order():
    model = tiny_llama()
    prompt = torch.randint(0, 97, (50,), generator=torch.Generator().manual_seed(1)).tolist()
    dense, _ = _run(model, create("dense", _spec(model)), prompt)
    rec = Recording(_spec(model), {"budget_tokens": 4096, "min_seq_len": 0})
    same, eng = _run(model, rec, prompt)
    assert same == dense
    assert rec.calls[:3] == ["request_begin", "estimate_num_slots", "build_sparse_meta"]
    assert rec.calls[3:8] == [
        "attention_begin:0",
        "attention_finished:0",
        "attention_begin:1",
        "attention_finished:1",
        "execute_finished",
    ]
    assert rec.calls[-1] == "request_finished"
    assert rec.stats()["sparse_layer_steps"] == 0  # budget covers the sequence: the switch keeps dense
    assert len(eng._free) == 64  # every block returned


def test_sparse_view_has_forced_blocks_per_head_and_matches_selected_attention():
    model = tiny_llama(seed=2)
    prompt = torch.randint(0, 97, (120,), generator=torch.Generator().manual_seed(3)).tolist()
    rec = Recording(
        _spec(model), {"budget_tokens": 48, "min_seq_len": 0, "sink_blocks": 1, "recent_blocks": 2}
    )
    out, _ = _run(model, rec, prompt, steps=5)
    assert len(out) == 5
    st = rec.stats()
    assert st["sparse_layer_steps"] == 2 * 4  # 4 decode steps x 2 layers
    sparse_views = [v for v in rec.views if v[0].shape[0] == 2]
    assert sparse_views
    for table, lens, seq in sparse_views:
        assert table.shape == (2, 6)  # 48 tokens / 8 per block, per KV head
        assert seq == 48
        # block 0 (sink) and the last two logical blocks are in every head's table
        for h in range(2):
            assert len(set(table[h].tolist())) == 6
        assert int(lens.sum(-1).max()) <= 48
    assert 0.0 <= st["step_reuse"] <= 1.0


def test_oracle_at_budget_sees_the_true_top_blocks_and_reuse_skips_selections():
    model = tiny_llama(seed=4)
    prompt = torch.randint(0, 97, (100,), generator=torch.Generator().manual_seed(5)).tolist()
    fresh = create("gsa", _spec(model), {"budget_tokens": 40, "min_seq_len": 0})
    _run(model, fresh, prompt, steps=7)
    reused = create("gsa", _spec(model), {"budget_tokens": 40, "min_seq_len": 0, "reuse_steps": 3})
    _run(model, reused, prompt, steps=7)
    assert reused.stats()["selections"] < fresh.stats()["selections"]
    assert reused.stats()["reused"] > 0
    qk = create("gsa", _spec(model), {"budget_tokens": 40, "min_seq_len": 0, "basis": "keys+queries"})
    out, _ = _run(model, qk, prompt, steps=3)
    assert len(out) == 3 and qk.stats()["selections"] > 0
    ahead = create("gsa", _spec(model), {"budget_tokens": 40, "min_seq_len": 0, "select_ahead": True})
    out, _ = _run(model, ahead, prompt, steps=7)
    assert len(out) == 7
    for name in ("quest", "meankey", "hata", "oracle"):
        out, _ = _run(model, create(name, _spec(model), {"budget_tokens": 40, "min_seq_len": 0}), prompt, 3)
        assert len(out) == 3


def test_batch_with_a_short_and_a_long_request():
    model = tiny_llama(seed=6)
    plugin = create("gsa", _spec(model), {"budget_tokens": 32, "min_seq_len": 64})
    eng = PagedEngine(model, plugin, num_blocks=64, block_size=BS)
    g = torch.Generator().manual_seed(7)
    eng.add_request("long", torch.randint(0, 97, (90,), generator=g).tolist())
    eng.add_request("short", torch.randint(0, 97, (20,), generator=g).tolist())
    logits = eng.decode(["long", "short"], [1, 2])
    assert logits.shape == (2, 97)
    assert plugin.stats()["sparse_layer_steps"] == 2 and plugin.stats()["dense_layer_steps"] >= 2
    eng.finish("long")
    eng.finish("short")


def test_switch_rules():
    cfg = BlockSparseConfig.from_mapping(
        {"budget_tokens": 64, "min_seq_len": 100, "min_long_requests": 2, "dense_layers": [0]}
    )
    batch = StepBatch(("a", "b", "c"), (500, 400, 50), (1, 1, 1))
    modes = decide_modes(batch, 3, cfg, 16, 8)
    assert modes[0] == (AttnMode.DENSE, AttnMode.SPARSE, AttnMode.SPARSE)
    assert modes[2] == (AttnMode.DENSE,) * 3  # short
    alone = decide_modes(StepBatch(("a", "c"), (500, 50), (1, 1)), 3, cfg, 16, 8)
    assert all(m is AttnMode.DENSE for row in alone for m in row)  # too few long requests
    prefill = decide_modes(StepBatch(("a", "b"), (500, 400), (500, 1)), 3, cfg, 16, 8)
    assert all(m is AttnMode.DENSE for m in prefill[0])


def test_the_cost_aware_switch_counts_the_key_elements_the_qualifying_requests_skip():
    base = {"budget_tokens": 64, "min_seq_len": 100}
    cfg = BlockSparseConfig.from_mapping(base)
    # 4 blocks of 16 selected: (500 - 64) + (400 - 64) tokens skipped; the short one is not counted
    assert skipped_kv([500, 400], cfg, 16, 8) == (436 + 336) * 8
    batch = StepBatch(("a", "b", "c"), (500, 400, 50), (1, 1, 1))
    for floor, sparse in ((0, True), (772 * 8, True), (772 * 8 + 1, False)):
        c = BlockSparseConfig.from_mapping({**base, "min_skipped_kv": floor})
        assert worth_sparse([500, 400], c, 16, 8) is sparse
        modes = decide_modes(batch, 2, c, 16, 8)
        want = AttnMode.SPARSE if sparse else AttnMode.DENSE
        assert modes[0] == modes[1] == (want, want), floor
        assert modes[2] == (AttnMode.DENSE,) * 2
    # the same floor is met by wider KV (more heads or a larger head dim)
    c = BlockSparseConfig.from_mapping({**base, "min_skipped_kv": 772 * 8 + 1})
    assert worth_sparse([500, 400], c, 16, 16)
    with pytest.raises(ValueError, match="min_skipped_kv"):
        BlockSparseConfig.from_mapping({**base, "min_skipped_kv": -1})


def test_configuration_is_validated_at_start():
    spec = ModelSpec(2, 4, 2, 16, 8)
    with pytest.raises(ValueError, match="unknown sparse configuration"):
        create("gsa", spec, {"budgt_tokens": 10})
    with pytest.raises(ValueError, match="budget_tokens"):
        create("gsa", spec, {"budget_tokens": 0})
    with pytest.raises(ValueError, match="exactly one"):
        create("gsa", spec, {"budget_tokens": 10, "budget_fraction": 0.1})
    with pytest.raises(ValueError, match="dense_layers"):
        create("gsa", spec, {"dense_layers": [5]})
    with pytest.raises(ValueError, match="rank"):
        create("gsa", spec, {"rank": 99})
    with pytest.raises(ValueError, match="unknown sparse configuration"):
        create("quest", spec, {"rank": 4})
    with pytest.raises(ValueError, match="unknown sparse algorithm"):
        create("nope", spec)
    with pytest.raises(ValueError, match="multiple"):
        ModelSpec(2, 5, 2, 16, 8)
    frac = create("gsa", spec, {"budget_fraction": 0.25})
    assert frac.cfg.selection.budget_for(1000) == 250
    base.register("gsa2", "kvfabric.ucm_layer.sparse.gsa.plugin:GSA")
    try:
        assert isinstance(create("gsa2", spec), GSA)
    finally:
        base.ALGORITHMS.unregister("gsa2")
    with pytest.raises(ValueError, match="unknown request"):
        frac.build_sparse_meta(StepBatch(("x",), (10,), (1,)), None)


def test_configuration_is_the_settings_language():
    """Every key typed and ranged (text converted as in a YAML file or a flag), an unknown
    key refused with the list of the known ones, a bad value an error naming its key."""
    spec = ModelSpec(2, 4, 2, 16, 8)
    plugin = create(
        "gsa",
        spec,
        {
            "budget_tokens": "64",
            "select_ahead": "yes",
            "dense_layers": ["1"],
            "rank": "4",
            "allocation": "Layer",
        },
    )
    assert plugin.cfg.selection.budget_tokens == 64 and plugin.cfg.selection.allocation == "layer"
    assert plugin.cfg.select_ahead is True and plugin.cfg.dense_layers == (1,)
    assert plugin.cfg.scorer_options == {"rank": "4"}  # the scorer converts it
    assert plugin.options.offload is False
    with pytest.raises(ValueError) as e:
        create("gsa", spec, {"rnak": 4})
    for known in (
        "budget_tokens",
        "rank",
        "query_weight",
        "offload",
        "cache_blocks",
        "scorer",
        "reuse_steps",
    ):
        assert repr(known) in str(e.value)
    with pytest.raises(ValueError) as e:  # hata's own keys are listed
        create("hata", spec, {"rank": 4})
    assert "'bits'" in str(e.value) and "'seed'" in str(e.value) and "'query_weight'" not in str(e.value)
    bad = {
        "reuse_steps": (0, "reuse_steps=0: expected an integer >= 1"),
        "select_ahead": ("maybe", "select_ahead='maybe': expected a boolean"),
        "allocation": ("global", "allocation='global': expected one of head, layer"),
        "head_cap": (0.5, "head_cap=0.5: expected a number >= 1"),
        "budget_fraction": (1.5, "budget_fraction=1.5"),
        "offload": ("perhaps", "offload='perhaps': expected a boolean"),
        "query_weight": (2, "gsa scorer option query_weight=2: expected a number in [0, 1]"),
        "select": ("best", "gsa scorer option select='best': expected one of bound, estimate, mixed"),
    }
    for key, (value, message) in bad.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            create("gsa", spec, {key: value})
    with pytest.raises(ValueError, match=re.escape("hata scorer option bits=0: expected an integer >= 1")):
        create("hata", spec, {"bits": 0})
