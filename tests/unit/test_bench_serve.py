"""The pure parts of ``kvfabric bench serve``: workload, statistics, ratios, row schema."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvfabric.bench.serve import Config, rows_of
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
    assert len(reqs) / t[-1] == pytest.approx(10.0, rel=0.1)
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
