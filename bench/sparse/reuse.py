"""Recall of a selection reused for several decode steps (what ``reuse_steps`` costs).

``python -m kvfabric.bench.sparse.reuse [SEED ...]``: on the synthetic 32K workload
(``SyntheticConfig(heads_per_type=2, steps=9)``, default seed 32,768, the benchmark's),
budget 2,048, block 16, sink 1 / recent 2, GSA's default and the oracle select at every step
``t`` and each selection is scored against the attention of step ``t + lag``; printed per
lag and per reuse window ``K`` (the mean over lags ``0..K-1``) as recall over the oracle's
fresh recall (medians over KV head, query head and step). docs/sparse.md quotes a run.
"""

from __future__ import annotations

import math
import sys

import torch

from kvfabric.bench.sparse.metrics import _recall, block_mass
from kvfabric.bench.sparse.synthetic import SyntheticConfig, generate
from kvfabric.ucm_layer.sparse.scorer import make_scorer
from kvfabric.ucm_layer.sparse.selection import SelectionConfig, select_free

LAGS = 9
WINDOWS = (1, 2, 4, 8)


def reuse_recalls(seed: int, budget: int = 2048, block_size: int = 16) -> dict[str, dict[int, float]]:
    """Method -> lag -> median recall of a selection ``lag`` steps old, over the oracle's
    fresh (lag 0) recall."""
    w = generate(SyntheticConfig(context=32768, heads_per_type=2, seed=seed, steps=LAGS))
    h, n, d = w.k.shape
    nb = -(-n // block_size)
    sel = SelectionConfig(budget_tokens=budget, sink_blocks=1, recent_blocks=2)
    kb = sel.num_selected(n, block_size)
    probs = [torch.softmax(w.q[s] @ w.k.transpose(1, 2) / math.sqrt(d), -1) for s in range(LAGS)]
    masses = [block_mass(p, block_size) for p in probs]
    raw: dict[str, dict[int, float]] = {}
    for name in ("gsa", "oracle"):
        sc = make_scorer(name, h, d, block_size)
        sc.fit(w.k, w.recent_prompt_q(256))
        rec: dict[int, list[torch.Tensor]] = {lag: [] for lag in range(LAGS)}
        for s in range(LAGS):
            if name == "oracle":
                free = select_free(masses[s].sum(1), nb, kb, sel)
            else:
                ranking, priority = sc.select_scores(w.q[s])
                free = select_free(ranking, nb, kb, sel, priority=priority, share=sc.priority_share)
            for lag in range(LAGS - s):
                rec[lag].append(_recall(masses[s + lag], free, nb, sel))
        raw[name] = {lag: float(torch.stack(v).median()) for lag, v in rec.items()}
    fresh = raw["oracle"][0]
    return {name: {lag: v / fresh for lag, v in by_lag.items()} for name, by_lag in raw.items()}


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    for seed in [int(x) for x in argv] or [32768]:
        res = reuse_recalls(seed)
        print(f"seed {seed}")
        for name, by_lag in res.items():
            lags = " ".join(f"{by_lag[lag]:.3f}" for lag in range(LAGS))
            windows = " / ".join(f"{sum(by_lag[lag] for lag in range(k)) / k:.3f}" for k in WINDOWS)
            print(f"  {name}: by lag {lags}; mean over K = {WINDOWS}: {windows}")


if __name__ == "__main__":
    main(sys.argv[1:])
