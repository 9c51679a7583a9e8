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


def test_predicted_hit_rate_and_ttft_match_the_engine(tiny_model: str) -> None:
    row, cal = list(run(plan=PLAN, model=tiny_model))
    assert row["case"] == "validate" and cal["case"] == "calibration"
    assert row["requests"] == PLAN.requests
    # the trace reused prefixes and the pool evicted: both sides have something to predict
    assert 0.4 < row["measured_hit_rate"] < 0.95, row
    assert row["predicted_evictions"] > 0, row
    assert abs(row["predicted_hit_rate"] - row["measured_hit_rate"]) <= HIT_POINTS, row
    foreign = row["foreign_cores"]
    quiet = foreign is not None and foreign < QUIET_FOREIGN_CORES
    bound = TTFT_REL if quiet else 2 * TTFT_REL
    assert row["ttft_p50_rel_error"] <= bound, (f"foreign_cores={foreign}, bound {bound}", row)
