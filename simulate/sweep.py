"""``--sweep KEY=V1,V2,...``: one cluster key varied, the smallest sizing that reaches a target.

Contract: :func:`run_sweep` replays a fresh copy of the same trace once per value (the
trace factory is called once per point) and returns the points in the order given;
:func:`recommend` is the first point, by value, whose hit rate reaches the target (None
when none does); :func:`plot` writes a PNG of hit rate and TTFT p50 / p99 against the
value (matplotlib, the ``plot`` extra) and returns its path.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from kvfabric.simulate.config import Calibration, ClusterConfig
from kvfabric.simulate.replay import Report, simulate
from kvfabric.simulate.trace import Request


@dataclass(frozen=True)
class SweepPoint:
    """One replay of the sweep: the key's value (as given and as the cluster holds it)."""

    key: str
    text: str
    value: float
    report: Report


def parse_sweep(spec: str) -> tuple[str, list[str]]:
    """``"dram_bytes=16GiB,32GiB"`` -> ``("dram_bytes", ["16GiB", "32GiB"])``."""
    key, sep, values = spec.partition("=")
    items = [v.strip() for v in values.split(",") if v.strip()]
    if not sep or not key.strip() or not items:
        raise ValueError(f"--sweep {spec!r}: expected KEY=V1,V2,... (e.g. dram_bytes=16GiB,32GiB,64GiB)")
    return key.strip(), items


def run_sweep(
    cluster: ClusterConfig,
    cal: Calibration,
    key: str,
    values: Iterable[str],
    trace: Callable[[], Iterable[Request]],
    progress: Callable[[str, int], None] | None = None,
) -> list[SweepPoint]:
    """One replay per value of ``key`` (module docstring); each value is checked as the
    cluster file's would be before anything runs."""
    configs = [(text, cluster.with_value(key, text)) for text in values]
    out = []
    for text, cfg in configs:
        cb = None if progress is None else (lambda n, text=text: progress(text, n))
        rep = simulate(cfg, cal, trace(), cb)
        out.append(SweepPoint(key, text, float(getattr(cfg, key)), rep))
    return out


def recommend(points: list[SweepPoint], target_hit_rate: float) -> SweepPoint | None:
    """The point of the smallest value whose hit rate is at least ``target_hit_rate``."""
    ok = [p for p in points if p.report.hit_rate >= target_hit_rate]
    return min(ok, key=lambda p: p.value) if ok else None


def plot(points: list[SweepPoint], out_dir: str | os.PathLike[str], target: float | None = None) -> Path:
    """A PNG of hit rate (per tier, stacked, and total) and TTFT against the swept value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    pts = sorted(points, key=lambda p: p.value)
    key = pts[0].key
    xs = [p.value / (1 << 30) if key.endswith("_bytes") else p.value for p in pts]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    bottom = [0.0] * len(pts)
    for tier in ("hbm", "dram", "ssd"):
        ys = [p.report.hit_rate_by_tier[tier] for p in pts]
        if any(ys):
            a.fill_between(xs, bottom, [u + v for u, v in zip(bottom, ys)], alpha=0.4, label=tier)
            bottom = [u + v for u, v in zip(bottom, ys)]
    a.plot(xs, [p.report.hit_rate for p in pts], "k.-", label="all tiers")
    if target is not None:
        a.axhline(target, color="r", ls="--", lw=1, label=f"target {target:g}")
    unit = " (GiB)" if key.endswith("_bytes") else ""
    a.set(xlabel=key + unit, ylabel="block hit rate", ylim=(0, 1), title="hit rate")
    a.legend(loc="lower right")
    b.plot(xs, [p.report.ttft_p50_s for p in pts], "o-", label="p50")
    b.plot(xs, [p.report.ttft_p99_s for p in pts], "s--", label="p99")
    b.set(xlabel=key + unit, ylabel="seconds", title="time to first token")
    b.legend()
    fig.tight_layout()
    path = d / f"sweep-{key}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["SweepPoint", "parse_sweep", "plot", "recommend", "run_sweep"]
