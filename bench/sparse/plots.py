"""PNG plots of the gsa benchmark: recall against budget, speed-up against budget."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def plot_rows(rows: Sequence[dict[str, Any]], out_dir: str | Path) -> list[Path]:
    """Write ``gsa_recall_<context>.png`` and ``gsa_speed.png``; returns the paths (none if
    matplotlib is missing: it is in the ``plot`` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    quality = [r for r in rows if r.get("case") == "synthetic"]
    for ctx in sorted({r["context"] for r in quality}):
        series: dict[str, list[tuple[int, float]]] = defaultdict(list)
        for r in quality:
            if r["context"] == ctx and r["method"] != "dense":
                series[r["method"]].append((r["budget"], r["recall"]))
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("token budget")
        ax.set_ylabel("attention-mass recall (median, outside forced blocks)")
        ax.set_title(f"synthetic, {ctx // 1024}K context")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        p = out / f"gsa_recall_{ctx // 1024}k.png"
        fig.tight_layout()
        fig.savefig(p, dpi=100)
        plt.close(fig)
        paths.append(p)
    speed = [r for r in rows if r.get("case") == "speed" and r.get("default", True)]
    if speed:
        fig, ax = plt.subplots(figsize=(6, 4))
        for ctx in sorted({r["context"] for r in speed}):
            pts = sorted((r["budget"], r["speedup_vs_dense"]) for r in speed if r["context"] == ctx)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{ctx // 1024}K")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("token budget")
        ax.set_ylabel("speed-up of the GSA step vs dense attention")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.grid(True, alpha=0.3)
        ax.legend(title="context")
        p = out / "gsa_speed.png"
        fig.tight_layout()
        fig.savefig(p, dpi=100)
        plt.close(fig)
        paths.append(p)
    return paths


__all__ = ["plot_rows"]
