"""``kvfabric sim`` against a real CPU vLLM engine with kvfabric's connector on a small trace.

``simulate/validate.py`` sends the trace to the engine one request at a time, with the
calibration probes (cold and at once warm prompts of a few lengths) spread over it, so the
prefill and load figures the prediction uses are measured on the machine as the trace sees
it; then the simulator replays the same sequence through the pool's own eviction code and
block ids, and the test compares. The tiny random-weight model keeps the run short. The
plan sits near a hit rate of 0.7, away from one half where the p50 falls between the hit
and the miss modes, and its pool holds no prompt larger than a fifth of it (the pool
stamps recency in 0.1 s ticks, so which blocks of one request go first is not the
replay's exact order).

The hit rate has to hold on any machine. The TTFT target (p50 within 25 %) is the
prediction's for the engine's own work: the row's ``foreign_cores`` says how much CPU other
processes took during the run, and when that was half a core or more the comparison is held
to twice the error instead (the simulator does not model a neighbour's load; docs/sim.md
has the runs under two busy loops that need it).
"""

from __future__ import annotations

from kvfabric.simulate.validate import HIT_POINTS, TTFT_REL, Plan, run

PLAN = Plan(
    requests=48,
    prefixes=3,
    prefix_tokens=1024,
    suffix_lo=64,
    suffix_hi=384,
    pool_blocks=200,
    calib_lengths=(256, 1024, 2048),
    probe_rounds=4,
)
#: cores' worth of CPU other processes may take before the TTFT target is relaxed
QUIET_FOREIGN_CORES = 0.5


def _check(tiny_model: str) -> tuple[float, float, dict]:
    """One run of the plan: the hit-rate checks, then (TTFT error, its bound, the row)."""
    row, cal = list(run(plan=PLAN, model=tiny_model))
    assert row["case"] == "validate" and cal["case"] == "calibration"
    assert row["requests"] == PLAN.requests
    # the trace reused prefixes and the pool evicted: both sides have something to predict
    assert 0.4 < row["measured_hit_rate"] < 0.95, row
    assert row["predicted_evictions"] > 0, row
    assert abs(row["predicted_hit_rate"] - row["measured_hit_rate"]) <= HIT_POINTS, row
    foreign = row["foreign_cores"]
    quiet = foreign is not None and foreign < QUIET_FOREIGN_CORES
    return row["ttft_p50_rel_error"], TTFT_REL if quiet else 2 * TTFT_REL, row


def test_predicted_hit_rate_and_ttft_match_the_engine(tiny_model: str) -> None:
    err, bound, row = _check(tiny_model)
    if err > bound:  # one more run: a 20 s timing on 2 cores was seen at 0.252 against 0.25
        err, bound, row = _check(tiny_model)
    assert err <= bound, (f"foreign_cores={row['foreign_cores']}, bound {bound}", row)
