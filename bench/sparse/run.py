"""``kvfabric bench gsa [--quick] [--json] [--out DIR] [--threads N]``.

One row per (method, context, budget) with ``method, default, context, budget, recall,
oracle_recall, recall_vs_oracle, out_err, needle_hit, bytes_frac, speedup_vs_dense``
(plus ``case`` and details; ``default`` is true on the rows of GSA's default
configuration, what ``create("gsa", ...)`` runs with no options), in four cases:

* ``synthetic``: every method on the calibrated synthetic workload (its statistics are
  printed first), at several contexts and budgets; the cost of each method next to the
  oracle's and dense's in the same run: ``select_ms`` (one decode step's scoring and top-k)
  and ``select_vs_oracle``, ``summary_bytes_per_block`` and ``summary_vs_kv`` (over the
  block's K and V bytes); ``speedup_vs_dense`` (default rows) is the timed
  decode-attention step of GSA's default scorer next to dense on the same tensors;
* ``needles``: the needle hit rate of GSA's variants, Quest and the oracle with 1 to 8
  needles of both kinds up to the largest context;
* ``speed``: the GSA step's components (scoring, top-k, gather, attention) at 8K, 32K and
  128K next to dense attention, for GSA's default and the default before (``gsa-r16``),
  with the scoring share (median and quartiles) and the machine's busy fraction while it
  was timed;
* ``smollm2``: SmolLM2-135M-Instruct on passkey prompts: real captured attention scored
  like the synthetic case, and the decode loop through the hooks (passkey answer and
  next-token KL against dense). Skipped with a note when the model cannot be fetched.

PNG plots of recall and speed against budget go to ``--out`` (default ./bench-results/).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from typing import Any

import torch

from kvfabric.bench.report import BenchContext, cpu_busy_fraction, machine_note, read_cpu_row
from kvfabric.bench.sparse.metrics import MethodSpec, Quality, evaluate
from kvfabric.bench.sparse.speed import time_steps
from kvfabric.bench.sparse.synthetic import SyntheticConfig, generate, stats

#: the prompt-query basis option (``basis="keys+queries"``) as measured here
QK = {"basis": "keys+queries", "query_weight": 0.25}
#: prompt tokens whose queries the scorers see (the plugin's ``query_window`` default)
QUERY_WINDOW = 256

KEYS = {"basis": "keys"}
METHODS = (
    MethodSpec("oracle", "oracle"),
    # GSA's defaults: rank head_dim / 4 (32 here), keys+queries basis (query_weight 0.35), mixed
    MethodSpec("gsa", "gsa", {}, default=True),
    MethodSpec("gsa-r16", "gsa", {"rank": 16, **KEYS}),  # the defaults before: keys basis
    MethodSpec("gsa-r16-bound", "gsa", {"rank": 16, "select": "bound", **KEYS}),  # ranked by the bound
    MethodSpec("gsa-r16-qk", "gsa", {"rank": 16, **QK}),
    MethodSpec("gsa-r32-qk", "gsa", {"rank": 32, **QK}),
    MethodSpec("gsa-r63-qk", "gsa", {"rank": 63, **QK}),  # 127 numbers: mean key's size
    MethodSpec("gsa-r64", "gsa", {"rank": 64, **KEYS}),
    MethodSpec("quest", "quest"),
    MethodSpec("meankey", "meankey"),
    MethodSpec("hata", "hata"),
)
NEEDLE_METHODS = ("oracle", "gsa", "gsa-r16", "gsa-r16-bound", "gsa-r16-qk", "gsa-r32-qk", "quest")


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _row(case: str, m: MethodSpec, q: Quality, speedup: float | None, **extra: Any) -> dict[str, Any]:
    return {
        "case": case,
        "method": q.method,
        "default": m.default,
        "context": q.context,
        "budget": q.budget,
        "recall": round(q.recall, 4),
        "oracle_recall": round(q.oracle_recall, 4),
        "recall_vs_oracle": round(q.recall_vs_oracle, 4),
        "out_err": round(q.out_err, 4),
        "needle_hit": round(q.needle_hit, 4),
        "bytes_frac": round(q.bytes_frac, 4),
        "speedup_vs_dense": None if speedup is None else round(speedup, 2),
        "recall_p10": round(q.recall_p10, 4),
        "out_err_p90": round(q.out_err_p90, 4),
        "recall_stale1": round(q.recall_stale1, 4),
        "recall_stale3": round(q.recall_stale3, 4),
        "summary_numbers": q.summary_numbers,
        "summary_bytes_per_block": q.summary_bytes_per_block,
        "summary_vs_kv": round(q.summary_vs_kv, 4),
        "select_ms": round(q.select_s * 1e3, 3),
        **extra,
    }


def _synthetic(ctx: BenchContext, contexts: list[int], budgets: list[int]) -> Iterator[dict[str, Any]]:
    speed: dict[tuple[int, int], float] = {}
    for n in contexts:
        w = generate(SyntheticConfig(context=n, heads_per_type=2, seed=n))  # quick: the same 32K workload
        st = stats(w)
        _say(f"synthetic {n // 1024}K: " + ", ".join(f"{k}={v:.3f}" for k, v in st.items()))
        for t in time_steps(n, budgets, rounds=ctx.rounds):
            speed[(n, t.budget)] = t.speedup
        oracle_select: dict[int, float] = {}  # budget -> the oracle's selection time
        for m in METHODS:  # the oracle first
            pq = w.recent_prompt_q(QUERY_WINDOW)
            for q in evaluate(m, w.q, w.k, w.v, budgets, needles=w.needles, prompt_q=pq):
                if m.scorer == "oracle":
                    oracle_select[q.budget] = q.select_s
                sp = speed[(n, q.budget)] if m.default else None
                yield _row(
                    "synthetic",
                    m,
                    q,
                    sp,
                    select_vs_oracle=round(q.select_s / oracle_select[q.budget], 3),
                    top2pct_mass=round(st["top2pct_mass"], 3),
                    sink_mass=round(st["sink_mass"], 3),
                )


def _needles(ctx: BenchContext, contexts: list[int]) -> Iterator[dict[str, Any]]:
    """GSA's variants, Quest and the oracle on 1, 4 and 8 needles, both kinds (a needle the
    oracle does not select at this budget carries too little attention to be found)."""
    methods = [m for m in METHODS if m.label in NEEDLE_METHODS]
    for n in contexts:
        for kind in ("keys", "query"):
            for k in (1, 4, 8):
                cfg = SyntheticConfig(context=n, heads_per_type=1, needles=k, seed=100 + k, needle_kind=kind)
                w = generate(cfg)
                for m in methods:
                    pq = w.recent_prompt_q(QUERY_WINDOW)
                    (q,) = evaluate(m, w.q, w.k, w.v, [2048], needles=w.needles, prompt_q=pq)
                    yield _row("needles", m, q, None, needles=k, needle_kind=kind)


#: the speed case: GSA's default, and the default before issue 13 (rank 16, keys basis)
SPEED_METHODS = (
    (MethodSpec("gsa", "gsa", {}, default=True)),
    MethodSpec("gsa-r16", "gsa", {"rank": 16, **KEYS}),
)


def _speed(ctx: BenchContext, contexts: list[int], budgets: list[int]) -> Iterator[dict[str, Any]]:
    for n, m in ((n, m) for n in contexts for m in SPEED_METHODS):
        cpu0 = read_cpu_row()
        timings = time_steps(n, budgets, rounds=max(ctx.rounds, 9), options=dict(m.options or {}))
        busy = round(cpu_busy_fraction((cpu0, read_cpu_row())), 2)
        for t in timings:
            yield {
                "case": "speed",
                "method": m.label,
                "default": m.default,
                "context": n,
                "budget": t.budget,
                "speedup_vs_dense": round(t.speedup, 2),
                "score_frac": round(t.score_frac, 3),
                "score_frac_p25": round(t.score_frac_p25, 3),
                "score_frac_p75": round(t.score_frac_p75, 3),
                "cpu_busy": busy,
                "dense_ms": round(t.dense_s * 1e3, 3),
                "sparse_ms": round(t.sparse_s * 1e3, 3),
                "score_ms": round(t.score_s * 1e3, 3),
                "topk_ms": round(t.topk_s * 1e3, 3),
                "gather_ms": round(t.gather_s * 1e3, 3),
                "attend_ms": round(t.attend_s * 1e3, 3),
            }


def run(ctx: BenchContext) -> Iterator[dict[str, Any]]:
    threads = int(ctx.options.get("threads", 1))
    torch.set_num_threads(threads)
    note = machine_note()
    cpu0 = read_cpu_row()
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    budgets = [512, 1024, 2048, 4096]
    contexts = [8192, 32768] if ctx.quick else [8192, 32768, 131072]
    _say(f"gsa bench: torch threads={threads}, {note}")
    parts = [
        _synthetic(ctx, [32768] if ctx.quick else [32768, 131072], budgets),
        _needles(ctx, [32768] if ctx.quick else contexts),
        _speed(ctx, contexts, [1024, 2048] if ctx.quick else budgets),
    ]
    from kvfabric.bench.sparse.realmodel import smollm2_rows

    parts.append(smollm2_rows(ctx, [2048] if ctx.quick else [8192]))
    for part in parts:
        for row in part:
            row.update(threads=threads)
            rows.append(row)
            yield row
    busy = cpu_busy_fraction((cpu0, read_cpu_row()))
    own = min(1.0, threads / max(1, note["ncpu"] or 1))
    other = "busy" if busy > own + 0.25 else "idle"
    _say(
        f"gsa bench: {time.perf_counter() - t0:.0f} s; machine busy fraction {busy:.2f} "
        f"(other cores {other} while it ran)"
    )
    from kvfabric.bench.sparse.plots import plot_rows

    for p in plot_rows(rows, ctx.options.get("out_dir", "bench-results")):
        _say(f"wrote {p}")


__all__ = ["METHODS", "run"]
