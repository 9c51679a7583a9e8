"""Wall time of one layer's sparse decode attention step next to dense, on the same tensors.

A paged cache ``(Hkv, nb, bs, D)`` whose blocks are consecutive (so dense attention reads
it as a free ``(Hkv, N, D)`` view: the best case for dense), float32, pre-touched. The
sparse step is GSA's: scoring (query projection + one product with the summaries + group
combination), top-k with the forced blocks, gather of the selected K and V blocks, and
attention over them. Components and the whole step are timed separately, rounds
interleaved with dense (ABAB), medians reported (and the quartiles of the per-round scoring
share); the thread count is fixed by the caller. The scorer is GSA's default (``mixed``
selection: one product for the estimate and the bound, a softmax and a max; its basis fitted
to the keys and random prompt queries, which changes what is selected, not what it costs).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvfabric.ucm_layer.sparse.attention import attend, gather_blocks
from kvfabric.ucm_layer.sparse.gsa.summary import SvdMaxNormScorer
from kvfabric.ucm_layer.sparse.selection import SelectionConfig, select_blocks


@dataclass(frozen=True)
class StepTiming:
    context: int
    budget: int
    dense_s: float
    sparse_s: float
    score_s: float
    topk_s: float
    gather_s: float
    attend_s: float
    score_frac_p25: float = float("nan")  # the scoring share of each round: quartiles
    score_frac_p75: float = float("nan")

    @property
    def speedup(self) -> float:
        return self.dense_s / self.sparse_s

    @property
    def score_frac(self) -> float:
        return self.score_s / self.sparse_s


def _median_time(fn: Callable[[], Any], reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def time_steps(
    context: int,
    budgets: list[int],
    num_kv_heads: int = 8,
    group: int = 4,
    head_dim: int = 128,
    block_size: int = 16,
    rank: int | None = None,
    rounds: int = 5,
    seed: int = 0,
    options: dict[str, Any] | None = None,
) -> list[StepTiming]:
    """Timings of the GSA step at each budget, and of dense, on one set of tensors
    (``options``: the GSA scorer's, its defaults when None)."""
    gen = torch.Generator().manual_seed(seed)
    nb = context // block_size
    shape = (num_kv_heads, nb, block_size, head_dim)
    k_cache = torch.randn(shape, generator=gen) + 0.5
    v_cache = torch.randn(shape, generator=gen)
    q = torch.randn((num_kv_heads, group, head_dim), generator=gen)
    kd, vd = k_cache.view(num_kv_heads, context, head_dim), v_cache.view(num_kv_heads, context, head_dim)
    opts = {"rank": rank, "basis_tokens": 8192, **(options or {})}
    scorer = SvdMaxNormScorer(num_kv_heads, head_dim, block_size, **opts)
    scorer.fit(kd, torch.randn((num_kv_heads, 256 * group, head_dim), generator=gen))
    share = scorer.priority_share

    def select(k: int, sel: SelectionConfig) -> torch.Tensor:
        ranking, priority = scorer.select_scores(q)
        return select_blocks(ranking, nb, k, sel, priority, share)

    reps = max(1, int(2**17 // context))  # small contexts: several calls per timing

    def dense() -> torch.Tensor:
        return attend(q, kd, vd)

    out = []
    for budget in budgets:
        sel = SelectionConfig(budget_tokens=budget)
        k = sel.num_selected(context, block_size)
        combined, prio = scorer.select_scores(q)
        table = select_blocks(combined, nb, k, sel, prio, share)
        ks, vs = gather_blocks(k_cache, table), gather_blocks(v_cache, table)
        fns: dict[str, Callable[[], Any]] = {
            "dense": dense,
            "sparse": lambda k=k, sel=sel: attend(
                q,
                gather_blocks(k_cache, t := select(k, sel)),
                gather_blocks(v_cache, t),
            ),
            "score": lambda: scorer.select_scores(q),
            "topk": lambda c=combined, p=prio, k=k, sel=sel: select_blocks(c, nb, k, sel, p, share),
            "gather": lambda table=table: (gather_blocks(k_cache, table), gather_blocks(v_cache, table)),
            "attend": lambda ks=ks, vs=vs: attend(q, ks, vs),
        }
        parts: dict[str, list[float]] = {n: [] for n in fns}
        for f in fns.values():
            f()  # warm up
        for _ in range(max(5, rounds)):
            for name, f in fns.items():
                parts[name].append(_median_time(f, reps))
        med = {n: statistics.median(v) for n, v in parts.items()}
        fracs = sorted(a / b for a, b in zip(parts["score"], parts["sparse"]))
        out.append(
            StepTiming(
                context,
                budget,
                med["dense"],
                med["sparse"],
                med["score"],
                med["topk"],
                med["gather"],
                med["attend"],
                fracs[len(fracs) // 4],
                fracs[(3 * len(fracs)) // 4],
            )
        )
    return out


__all__ = ["StepTiming", "time_steps"]
