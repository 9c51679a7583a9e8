"""``kvfabric sim`` against a real CPU vLLM engine with kvfabric's connector on a small trace.

``simulate/validate.py`` sends the trace to the engine one request at a time, with the
calibration probes (cold and at once warm prompts of a few lengths) interleaved with it, so
the prefill and load figures the prediction uses are measured on the machine as the trace
sees it; then the simulator replays the same sequence through the pool's own eviction code
and block ids. The tiny random-weight model keeps the run short; its pool is sized so the
trace evicts and no single prompt is more than a fifth of it (the pool stamps recency in
0.1 s ticks, so which blocks of one request go first is not the simulator's exact order).
"""

from __future__ import annotations

from kvfabric.simulate.validate import HIT_POINTS, TTFT_REL, Plan, run

PLAN = Plan(
    requests=16,
    prefixes=3,
    prefix_tokens=320,
    suffix_lo=32,
    suffix_hi=160,
    pool_blocks=64,
    calib_lengths=(96, 320, 640),
    probe_rounds=4,
)


def test_predicted_hit_rate_and_ttft_match_the_engine(tiny_model: str) -> None:
    row, cal = list(run(plan=PLAN, model=tiny_model))
    assert row["case"] == "validate" and cal["case"] == "calibration"
    assert row["requests"] == PLAN.requests
    # the trace reused prefixes and the pool evicted: both sides have something to predict
    assert 0.2 < row["measured_hit_rate"] < 0.9, row
    assert row["predicted_evictions"] > 0, row
    assert abs(row["predicted_hit_rate"] - row["measured_hit_rate"]) <= HIT_POINTS, row
    assert row["ttft_p50_rel_error"] <= TTFT_REL, row
