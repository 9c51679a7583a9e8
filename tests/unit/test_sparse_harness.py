"""The evaluation harness: synthetic workload, quality metrics, step timing, plots."""

from __future__ import annotations

import pytest
import torch
from torch_threads import one_torch_thread  # noqa: F401

from kvfabric.bench import BENCHMARKS
from kvfabric.bench.sparse.metrics import MethodSpec, evaluate
from kvfabric.bench.sparse.plots import plot_rows
from kvfabric.bench.sparse.speed import time_steps
from kvfabric.bench.sparse.synthetic import HeadType, SyntheticConfig, generate, stats


@pytest.fixture(scope="module")
def work():
    return generate(SyntheticConfig(context=4096, head_dim=64, heads_per_type=1, needles=3, seed=1))


def test_synthetic_workload_shapes_needles_and_statistics(work):
    assert work.q.shape == (4, 3, 4, 64) and work.k.shape == (3, 4096, 64) == work.v.shape
    assert work.head_types == (HeadType.STREAMING, HeadType.RETRIEVAL, HeadType.DIFFUSE)
    assert len(work.needles) == 4  # 3 single-token needles + 1 span, all in the retrieval head
    assert all(h == 1 and 0 < a <= b < 4096 for h, a, b in work.needles)
    st = stats(work)
    assert set(st) >= {"top2pct_mass", "sink_mass", "top2pct_mass_retrieval", "sink_mass_streaming"}
    assert all(0.0 <= v <= 1.0 for k, v in st.items() if not k.startswith("q_cos"))
    # head types differ as designed: streaming heads sink more, diffuse heads concentrate less
    assert st["sink_mass_streaming"] > st["sink_mass_diffuse"]
    assert st["top2pct_mass_retrieval"] > st["top2pct_mass_diffuse"]
    again = generate(SyntheticConfig(context=4096, head_dim=64, heads_per_type=1, needles=3, seed=1))
    assert torch.equal(again.k, work.k) and again.needles == work.needles
    # prompt queries: 64 positions spread over the prompt and 64 in its last 256 tokens
    assert work.prompt_q.shape == (3, 4 * 128, 64) and work.prompt_pos.shape == (128,)
    assert bool((work.prompt_pos[1:] > work.prompt_pos[:-1]).all()) and int(work.prompt_pos[-1]) < 4096
    recent = work.recent_prompt_q(256)
    assert recent.shape == (3, 4 * 64, 64) and torch.equal(recent, work.prompt_q[:, -4 * 64 :])
    assert torch.equal(work.recent_prompt_q(0), work.prompt_q)
    # they share the head's persistent query direction with the decode queries (calibrated
    # on SmolLM2: cosine with the recent prompt queries' mean ~0.7)
    assert 0.4 < st["q_cos_mean"] < 0.95 and st["q_cos_token"] < st["q_cos_mean"]
    with pytest.raises(ValueError):
        SyntheticConfig(context=100)
    with pytest.raises(ValueError, match="needle_kind"):
        SyntheticConfig(needle_kind="nope")
    keys_kind = generate(
        SyntheticConfig(context=4096, head_dim=64, heads_per_type=1, needles=3, seed=1, needle_kind="keys")
    )
    assert keys_kind.needles == work.needles and not torch.equal(keys_kind.k[1], work.k[1])


def test_metrics_oracle_full_budget_and_methods(work):
    (orc,) = evaluate(MethodSpec("oracle", "oracle"), work.q, work.k, work.v, [512], needles=work.needles)
    assert orc.recall_vs_oracle == pytest.approx(1.0)
    assert orc.needle_hit == 1.0
    (full,) = evaluate(MethodSpec("gsa", "gsa", {"rank": 8}), work.q, work.k, work.v, [4096])
    assert full.recall == pytest.approx(1.0) and full.out_err < 1e-4
    rows = evaluate(
        MethodSpec("gsa", "gsa", {"rank": 8}), work.q, work.k, work.v, [256, 1024], needles=work.needles
    )
    assert rows[0].recall <= rows[1].recall + 1e-6
    assert rows[0].bytes_frac < rows[1].bytes_frac < 1.0
    assert rows[0].summary_numbers == 17
    for r in rows:
        assert 0.0 <= r.recall_p10 <= r.recall <= 1.0 and 0.0 <= r.needle_hit <= 1.0
        assert r.recall_stale1 >= 0.0 and r.recall_stale3 >= 0.0
    qk = evaluate(
        MethodSpec("gsa-qk", "gsa", {"rank": 8, "basis": "keys+queries"}),
        work.q,
        work.k,
        work.v,
        [256],
        prompt_q=work.prompt_q,
    )[0]
    assert 0.0 < qk.recall <= 1.0
    # no prompt queries: the query-aware basis is the keys' basis
    (no_q,) = evaluate(MethodSpec("gsa-qk", "gsa", {"rank": 8}), work.q, work.k, work.v, [256])
    (keys,) = evaluate(
        MethodSpec("gsa-k", "gsa", {"rank": 8, "basis": "keys"}), work.q, work.k, work.v, [256]
    )
    assert no_q.recall == keys.recall == rows[0].recall
    # the cost next to the oracle's: selection time, summary bytes against the block's K and V
    assert qk.select_s > 0.0 and qk.summary_bytes_per_block == 17 * 4.0
    assert qk.summary_vs_kv == pytest.approx(17 * 4.0 / (2 * 16 * 64 * 4))
    quest = evaluate(MethodSpec("quest", "quest"), work.q, work.k, work.v, [256])[0]
    mean = evaluate(MethodSpec("meankey", "meankey"), work.q, work.k, work.v, [256])[0]
    assert quest.summary_numbers == 128 and mean.summary_numbers == 64


def test_step_timing_and_plots(tmp_path):
    (t,) = time_steps(2048, [256], num_kv_heads=2, group=2, head_dim=32, rounds=1)
    assert t.dense_s > 0 and t.sparse_s > 0 and 0 < t.score_frac < 1
    assert BENCHMARKS.target("gsa") == "kvfabric.bench.sparse.run:run"
    pytest.importorskip("matplotlib")
    rows = [
        {"case": "synthetic", "method": m, "context": 2048, "budget": b, "recall": r}
        for m, b, r in (("gsa", 256, 0.5), ("gsa", 512, 0.7), ("quest", 256, 0.6))
    ] + [{"case": "speed", "method": "gsa", "context": 2048, "budget": 256, "speedup_vs_dense": t.speedup}]
    paths = plot_rows(rows, tmp_path / "plots")
    assert {p.name for p in paths} == {"gsa_recall_2k.png", "gsa_speed.png"}
    assert all(p.stat().st_size > 1000 for p in paths)
