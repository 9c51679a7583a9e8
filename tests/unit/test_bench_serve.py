"""The pure parts of ``kvfabric bench serve``: workload, statistics, ratios, row schema."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from kvfabric.bench.serve import rows_of
from kvfabric.bench.serve_configs import Config
from kvfabric.bench.serve_workload import (
    QUICK,
    ROW_KEYS,
    ConfigKind,
    Phase,
    Preset,
    RequestRecord,
    add_ratios,
    floor_figures,
    make_prefixes,
    make_row,
    make_workload,
    percentile,
    phase_stats,
)

P = Preset(
    "t",
    prefixes=3,
    prefix_tokens=64,
    requests_per_prefix=4,
    question_tokens=8,
    output_tokens=4,
    kv_cache_tokens=96,
)


def test_workload_shares_prefixes_with_distinct_questions() -> None:
    reqs = make_workload(P, seed=1, qps=None)
    assert len(reqs) == P.requests == 12
    assert all(r.arrival_s == 0 for r in reqs)
    pre = make_prefixes(P, 1)
    for r in reqs:
        assert len(r.prompt) == 72
        assert r.prompt[:64] == pre[r.prefix_id]
    assert sorted(r.prefix_id for r in reqs) == sorted([0, 1, 2] * 4)
    assert len({r.prompt for r in reqs}) == 12  # every question its own
    assert len({r.req_id for r in reqs}) == 12
    assert make_workload(P, seed=1, qps=None) == reqs  # seeded
    assert {p[:32] for p in make_prefixes(P, 2)}.isdisjoint({p[:32] for p in pre})


def test_workload_arrivals_follow_the_rate() -> None:
    big = Preset("b", 50, 32, 40, 1, 1, 64)
    reqs = make_workload(big, seed=3, qps=10.0)
    t = [r.arrival_s for r in reqs]
    assert t == sorted(t) and t[0] == 0
    assert (len(reqs) - 1) / t[-1] == pytest.approx(10.0, rel=1e-9)  # the offered rate exactly
    gaps = sorted(b - a for a, b in itertools.pairwise(t))
    assert gaps[len(gaps) // 10] < 0.05 < 0.15 < gaps[-len(gaps) // 10]  # exponential, not even
    shared = make_workload(P, seed=5, qps=2.0, prefixes=make_prefixes(P, 9))
    assert shared[0].prompt[:64] in make_prefixes(P, 9)
    with pytest.raises(ValueError):
        make_workload(P, seed=1, qps=0)


def test_presets_put_the_working_set_beyond_vllms_cache() -> None:
    from kvfabric.bench.serve_workload import FULL

    for p in (QUICK, FULL):
        assert p.kv_cache_tokens < p.working_set_tokens
        assert p.kv_cache_tokens >= p.max_model_len  # one request still fits
        assert p.max_model_len % 32 == 0


def test_percentile_matches_numpy() -> None:
    rng = np.random.default_rng(0)
    v = rng.random(37).tolist()
    for q in (0, 50, 90, 99, 100):
        assert percentile(v, q) == pytest.approx(float(np.percentile(v, q)))
    assert math.isnan(percentile([], 50))
    assert percentile([2.0], 99) == 2.0
    with pytest.raises(ValueError):
        percentile(v, 101)


def test_phase_stats() -> None:
    recs = [RequestRecord(float(i), float(i) + 1, 100, 50 if i % 2 else 0, 4) for i in range(1, 5)]
    st = phase_stats(recs, wall_s=8.0)
    assert st["requests_per_s"] == 0.5
    assert st["output_tokens_per_s"] == 2.0
    assert st["ttft_p50_s"] == 2.5
    assert st["hit_rate"] == 0.25
    assert st["hit_tokens"] == 100 and st["prompt_tokens"] == 400
    assert st["requests_hit"] == 2 and st["ttft_p50_hit_s"] == 2.0 and st["ttft_p50_miss_s"] == 3.0
    assert phase_stats(recs[:1], 1.0)["ttft_p50_miss_s"] is None
    with pytest.raises(ValueError):
        phase_stats([], 1.0)


def _row(config: str, kind: ConfigKind, phase: Phase, ttft: float, rps: float) -> dict:
    return make_row(config, kind, phase, ttft_p50_s=ttft, requests_per_s=rps)


def test_ratios_against_vllm_and_the_best_peer() -> None:
    rows = add_ratios(
        [
            _row("vllm", ConfigKind.BASELINE, Phase.SATURATION, 4.0, 1.0),
            _row("A", ConfigKind.PEER, Phase.SATURATION, 2.0, 1.5),
            _row("B", ConfigKind.PEER, Phase.SATURATION, 3.0, 1.2),
            make_row("C", ConfigKind.PEER, Phase.SATURATION, status="error", error="no"),
            _row("kvf", ConfigKind.KVFABRIC, Phase.SATURATION, 1.0, 2.0),
            _row("kvf2", ConfigKind.KVFABRIC, Phase.SECOND_ENGINE, 0.5, 3.0),
            _row("kvf", ConfigKind.KVFABRIC, Phase.RATE, 1.0, 2.0),  # no baseline in this phase
        ]
    )
    by = {(r["config"], r["phase"]): r for r in rows}
    k = by["kvf", "saturation"]
    assert k["ratio_ttft_p50_vs_vllm"] == 4.0
    assert k["ratio_requests_per_s_vs_vllm"] == 2.0
    assert k["ratio_vs_best_peer"] == 2.0 and k["best_peer"] == "A"
    assert k["ratio_requests_per_s_vs_best_peer"] == pytest.approx(1.333, abs=1e-3)
    assert by["vllm", "saturation"]["ratio_ttft_p50_vs_vllm"] == 1.0
    assert by["A", "saturation"]["ratio_vs_best_peer"] == 1.0
    assert by["kvf2", "second_engine"]["ratio_ttft_p50_vs_vllm"] == 8.0  # against saturation
    assert by["C", "saturation"]["ratio_ttft_p50_vs_vllm"] is None
    assert by["kvf", "rate"]["ratio_ttft_p50_vs_vllm"] is None
    for r in rows:
        assert set(ROW_KEYS) <= set(r)


def test_floor() -> None:
    f = floor_figures(hit_bytes=2_000_000_000, memcpy_gbps=4.0, resident_ttft_s=0.5, warm_ttft_s=2.0)
    assert f["floor_copy_s"] == 0.5
    assert f["ttft_floor_s"] == 1.0
    assert f["ratio_warm_ttft_vs_floor"] == 2.0
    with pytest.raises(ValueError):
        floor_figures(1, 0.0, 0.5, 1.0)


def test_rows_of_a_result_and_of_a_crash() -> None:
    rec = {"ttft_s": 1.0, "latency_s": 2.0, "prompt_tokens": 10, "cached_tokens": 5, "output_tokens": 2}
    st = phase_stats([RequestRecord(**rec)], 2.0)
    result = {
        "phases": [{"phase": "saturation", "qps": None, "stats": st, "records": [rec]}],
        "floor": {
            "warm_ttft_s": 0.3,
            "resident_ttft_s": 0.1,
            "hit_tokens": 512,
            "hit_bytes": 512 * 46080,
            "memcpy_gbps": 5.0,
            "spans_s": {"lookup": 0.01, "load": 0.05, "request": 0.3},
            "rounds": 3,
        },
        "kv_cache_blocks": 24,
    }
    rows = rows_of(Config("kvf", ConfigKind.KVFABRIC, {}, floor=True), result, QUICK)
    assert [r["phase"] for r in rows] == ["saturation", "warm_single"]
    w = rows[1]
    assert w["ttft_floor_s"] > 0.1 and w["ratio_warm_ttft_vs_floor"] > 1
    assert w["breakdown_other_s"] == pytest.approx(0.3 - 0.1 - 0.01 - 0.05, abs=1e-4)
    crash = rows_of(Config("x", ConfigKind.PEER, {}), {"error": "ImportError: no  module\n named x"}, QUICK)
    assert (
        len(crash) == 1
        and crash[0]["status"] == "error"
        and crash[0]["error"] == "ImportError: no module named x"
    )
    assert set(ROW_KEYS) <= set(crash[0])


def test_flanked_schedule_puts_the_baseline_around_every_configuration() -> None:
    from kvfabric.bench.flank import flanked_schedule

    assert flanked_schedule(["a", "b"], "v") == ["v", "a", "v", "b", "v"]
    assert flanked_schedule([], "v") == ["v"]
    with pytest.raises(ValueError, match="baseline"):
        flanked_schedule(["v", "a"], "v")


def test_flank_figures_take_the_baseline_runs_next_to_each_run() -> None:
    from kvfabric.bench.serve_workload import flank_figures

    def st(ttft: float, rps: float) -> dict:
        return {"ttft_p50_s": ttft, "requests_per_s": rps}

    # the baseline drifts 4x slower over the run; each run is set against its own neighbours
    runs = [
        ("v", st(1.0, 4.0)),
        ("a", st(0.5, 8.0)),
        ("v", st(4.0, 1.0)),
        ("b", {}),  # a failed run: no figures, and no effect on the others
        ("v", st(4.0, 1.0)),
        ("c", st(2.0, 2.0)),
    ]
    figs = flank_figures(runs, "v")
    assert figs[0] is None and figs[2] is None and figs[4] is None
    assert figs[1] == {"vllm_adjacent_ttft_p50_s": 2.0, "vllm_adjacent_requests_per_s": 2.0}  # geomean
    assert figs[3] == {"vllm_adjacent_ttft_p50_s": 4.0, "vllm_adjacent_requests_per_s": 1.0}
    assert figs[5] == {"vllm_adjacent_ttft_p50_s": 4.0, "vllm_adjacent_requests_per_s": 1.0}  # one side
    assert flank_figures([("a", st(1.0, 1.0))], "v") == [None]
    rows = add_ratios(
        [
            {**_row("v", ConfigKind.BASELINE, Phase.SATURATION, 3.0, 1.5)},
            {**_row("a", ConfigKind.PEER, Phase.SATURATION, 0.5, 8.0), **figs[1]},
            {**_row("c", ConfigKind.KVFABRIC, Phase.SATURATION, 2.0, 2.0), **figs[5]},
        ]
    )
    a, c = rows[1], rows[2]
    assert a["ratio_ttft_p50_vs_vllm"] == 4.0 and a["ratio_requests_per_s_vs_vllm"] == 4.0
    assert c["ratio_ttft_p50_vs_vllm"] == 2.0 and c["ratio_requests_per_s_vs_vllm"] == 2.0
    # against the best peer: each side's ratio to its own adjacent baseline
    assert c["best_peer"] == "a" and c["ratio_vs_best_peer"] == 0.5
    assert c["ratio_requests_per_s_vs_best_peer"] == 0.5


def test_pooled_baseline_runs() -> None:
    from kvfabric.bench.serve import _pooled

    def run(ttfts: list[float], wall: float) -> dict:
        recs = [RequestRecord(t, t + 1, 10, 0, 2) for t in ttfts]
        return {
            "phase": "rate",
            "qps": 1.0,
            "stats": phase_stats(recs, wall),
            "records": [r.__dict__ for r in recs],
        }

    p = _pooled([run([1.0, 2.0], 2.0), run([3.0, 4.0], 6.0)])
    assert p["runs"] == 2 and p["requests_per_s_runs"] == [1.0, 0.3333]
    assert p["stats"]["requests"] == 4 and p["stats"]["requests_per_s"] == 0.5
    assert p["stats"]["ttft_p50_s"] == 2.5 and p["ttft_p50_s_runs"] == [1.5, 3.5]


def test_one_order_seed_gives_every_run_the_same_reuse_pattern() -> None:
    a = make_workload(P, seed=11, qps=2.0, order_seed=7)
    b = make_workload(P, seed=12, qps=2.0, order_seed=7)
    assert [(r.prefix_id, r.arrival_s) for r in a] == [(r.prefix_id, r.arrival_s) for r in b]
    assert {r.prompt for r in a}.isdisjoint({r.prompt for r in b})
    c = make_workload(P, seed=11, qps=2.0, order_seed=8)
    assert [r.arrival_s for r in a] != [r.arrival_s for r in c]


@pytest.mark.parametrize(("name", "least"), [("FULL", 3), ("QUICK", 2)])
def test_saturation_queue_has_repeats_vllms_own_cache_has_evicted_in_its_first_half(
    name: str, least: int
) -> None:
    """TTFT p50 at saturation is set by the first half of a first-come queue: each preset
    (5-10 requests per prefix, as the serving workload is sketched) must put there repeats
    whose prefix is not the request right before (vLLM's cache holds about one prefix), or
    an external tier cannot move p50."""
    from kvfabric.bench import serve_workload
    from kvfabric.bench.serve import SEEDS

    preset: Preset = getattr(serve_workload, name)
    assert 5 <= preset.requests_per_prefix <= 10
    assert preset.kv_cache_tokens < 2 * (preset.prefix_tokens + preset.question_tokens)
    seed = SEEDS[Phase.SATURATION]
    prefixes = make_prefixes(preset, seed * 100)
    reqs = make_workload(preset, seed * 100, None, prefixes, seed)
    order = [prefixes.index(tuple(r.prompt[: preset.prefix_tokens])) for r in reqs]
    half = order[: len(order) // 2]
    far = [i for i, p in enumerate(half) if p in half[:i] and half[i - 1] != p]
    assert len(far) >= least, order
