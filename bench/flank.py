"""Flanked runs: each configuration between two runs of a baseline, and its ratios taken
against the baseline runs next to it in time.

The machines these benchmarks run on are shared, and their load drifts over a run of
minutes. A configuration measured once after its baseline can read a ratio the drift made
(a baseline that ran in a busy minute). :func:`flanked_schedule` orders the runs
``b, c1, b, c2, b, ...``; :func:`adjacent_means` gives each non-baseline run the geometric
mean of the baseline's figure in the nearest runs before and after it. ``bench serve``
(vLLM alone around each connector) and ``bench sparse-vllm`` (the stock backend around each
sparse run, ``rounds``) use both. Pure functions: no clock, no engine.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def flanked_schedule(configs: Sequence[str], baseline: str) -> list[str]:
    """The run order: ``baseline`` first, then each of ``configs`` followed by ``baseline``
    again (``b, c1, b, c2, b, ..., cn, b``), so every configuration runs between two
    baseline runs and a drift in the machine's load moves both sides of its ratio alike."""
    if baseline in configs:
        raise ValueError(f"the baseline {baseline!r} is not one of the configurations it flanks")
    out = [baseline]
    for c in configs:
        out += [c, baseline]
    return out


def adjacent_means(is_baseline: Sequence[bool], values: Sequence[float | None]) -> list[float | None]:
    """For each run (in the order they ran), the geometric mean of ``values`` of the
    nearest baseline run before it and the nearest after it that have a value (a positive
    number; one side alone where the other has none). None for a baseline run and for a
    run with no such baseline run on either side."""
    if len(is_baseline) != len(values):
        raise ValueError(f"{len(is_baseline)} runs but {len(values)} values")

    def ok(j: int) -> bool:
        v = values[j]
        return is_baseline[j] and isinstance(v, (int, float)) and v > 0

    out: list[float | None] = []
    for i, base in enumerate(is_baseline):
        if base:
            out.append(None)
            continue
        sides = [
            values[j]
            for j in (
                next((j for j in range(i - 1, -1, -1) if ok(j)), None),
                next((j for j in range(i + 1, len(values)) if ok(j)), None),
            )
            if j is not None
        ]
        out.append(math.prod(sides) ** (1 / len(sides)) if sides else None)  # type: ignore[arg-type]
    return out


__all__ = ["adjacent_means", "flanked_schedule"]
