"""``kvfabric sim calibrate``: a :class:`~kvfabric.simulate.config.Calibration` from bench rows.

Contract: :func:`calibrate` reads the JSON rows of ``kvfabric bench ... --json`` runs and
takes each figure from the rows that measure it; ``overrides`` (``key=value``) fill in
or replace figures (another machine's, or one no bench here measures); a figure that is
required and neither measured nor given is an error naming it and the bench that
measures it.

* ``bench e2e`` ``ttft`` rows: prefill. Cold TTFT at each prompt length is fitted as
  ``base + n / tokens_per_s + attn * n^2 / 2`` (:func:`fit_prefill`, least squares with
  the terms kept non-negative); the warm-through-kvfabric TTFT of the same prompt less
  the prefill of the tokens it did not load is the load time of ``loaded_blocks``
  blocks, whose bytes the ``delegator`` rows of the run give (``nbytes`` of the
  ``smollm2-cpu-pages`` layout over its 64 blocks): ``load_fixed_s`` and
  ``dram_load_gbps`` from a line through those (:func:`fit_load`; where the per-byte
  cost is below resolution, the bandwidth is the median ``memcpy_gbps`` of ``bench
  store`` rows when there are some).
* ``bench copy`` rows of ``case: cross-process``, ``op: read`` (a load reads the pool's
  window, which another process owns, into the engine's buffer): ``dram_load_gbps``, the
  median ``gbps`` over the page kinds at the largest size copied, when no ``bench e2e``
  rows gave it.
* ``bench store`` rows of ``store: posix``, ``op: load``: ``ssd_load_gbps`` (the median).
* ``bench rpc`` rows: ``lookup_rpc_s`` from the smallest ``rpc_p50_us_spin``.

``decode_tokens_per_s`` is measured by no bench here: give it (``kvfabric sim validate``
measures it on the CPU engine and writes a whole calibration).
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from kvfabric.simulate.config import Calibration, load_calibration

E2E_LAYOUT = "smollm2-cpu-pages"
E2E_DUMP_BLOCKS = 64  #: blocks per delegator row of bench e2e (bench/e2e.py DUMP_BLOCKS)


def read_rows(paths: Iterable[str | os.PathLike[str]]) -> list[dict[str, Any]]:
    """Every JSON object line of the files (other lines, e.g. log text, are skipped)."""
    rows = []
    for p in paths:
        with open(p) as f:
            for line in f:
                line = line.strip()
                if line.startswith("{"):
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError:
                        continue
                    if isinstance(obj, dict):
                        rows.append(obj)
    return rows


def fit_prefill(points: Sequence[tuple[int, int, float]]) -> tuple[float, float, float]:
    """``(base_s, tokens_per_s, attn_s)`` fitting ``seconds = base + n / tps + attn * n *
    (c + n / 2)`` to ``(new tokens n, cached tokens c, seconds)`` points; a term the fit
    makes negative is dropped and the rest refitted; a per-token term the attention term
    drives negative (points that grow faster than linearly, e.g. noise on short prompts)
    drops the attention term instead, so time that grows with length always fits."""
    if len(points) < 2:
        raise ValueError(f"fitting prefill needs at least 2 (tokens, seconds) points, got {len(points)}")
    a = np.array([[1.0, n, n * (c + n / 2)] for n, c, _ in points])
    y = np.array([t for _, _, t in points])
    keep = [0, 1, 2]
    while True:
        coef, *_ = np.linalg.lstsq(a[:, keep], y, rcond=None)
        neg = [k for k, v in zip(keep, coef) if v < 0 and k != 1]
        if not neg and 2 in keep and coef[keep.index(1)] <= 0:
            neg = [2]
        if not neg:
            break
        keep.remove(neg[0])
    full = dict.fromkeys(range(3), 0.0)
    full.update(dict(zip(keep, (float(v) for v in coef))))
    if full[1] <= 0:
        raise ValueError(f"prefill time does not grow with prompt length in these points: {list(points)}")
    return full[0], 1.0 / full[1], full[2]


def fit_load(points: Sequence[tuple[float, float]], memcpy_gbps: float | None = None) -> tuple[float, float]:
    """``(fixed_s, gbps)`` fitting ``seconds = fixed + bytes / (gbps * 1e9)`` to ``(bytes,
    seconds)`` points (least squares). A fit whose per-byte term is below what memory can
    do (faster than ``memcpy_gbps``, or not growing with bytes) cannot resolve the per-byte
    cost: the bandwidth is then ``memcpy_gbps`` and the fixed term the median of the rest.
    A negative fixed term is 0 with the line through the origin. Without ``memcpy_gbps`` an
    unresolved fit is the median bandwidth of the points, with no fixed term."""
    xs = np.array([b for b, _ in points], float)
    ys = np.array([t for _, t in points], float)
    slope, fixed = np.polyfit(xs, ys, 1) if len(points) >= 2 and np.ptp(xs) > 0 else (0.0, 0.0)
    floor = 1.0 / (memcpy_gbps * 1e9) if memcpy_gbps else 0.0
    if slope > floor and fixed >= 0:
        return float(fixed), 1.0 / slope / 1e9
    if slope > floor:  # negative intercept: through the origin
        return 0.0, float((xs * xs).sum() / (xs * ys).sum() / 1e9)
    if memcpy_gbps:
        rest = ys - xs * floor
        return max(0.0, float(np.median(rest))), float(memcpy_gbps)
    return 0.0, statistics.median(load_gbps(b, t) for b, t in points)


def load_gbps(nbytes: float, seconds: float) -> float:
    """GB/s of a load of ``nbytes`` that took ``seconds`` (refused when not positive)."""
    if seconds <= 0 or nbytes <= 0:
        raise ValueError(
            f"a load of {nbytes:.0f} B in {seconds:.4f} s: warm TTFT is not above the fitted prefill; "
            "the machine was too noisy to measure the load"
        )
    return nbytes / seconds / 1e9


def calibrate(rows: Sequence[Mapping[str, Any]], overrides: Iterable[str] = ()) -> Calibration:
    """A calibration from bench rows and ``key=value`` overrides (module docstring)."""
    found: dict[str, Any] = {}
    sources: list[str] = []
    ttft = [r for r in rows if r.get("case") == "ttft" and "ttft_cold_s" in r]
    if ttft:
        pts = [(int(r["prompt_tokens"]), 0, float(r["ttft_cold_s"])) for r in ttft]
        base, tps, attn = fit_prefill(pts)
        found.update(prefill_base_s=base, prefill_tokens_per_s=tps, prefill_attn_s=attn)
        sources.append(f"bench e2e ttft rows ({len(ttft)} lengths)")
        lay = [r for r in rows if r.get("case") == "delegator" and r.get("layout") == E2E_LAYOUT]
        if lay:
            block_bytes = int(lay[0]["nbytes"]) // E2E_DUMP_BLOCKS
            cal0 = Calibration(prefill_tokens_per_s=tps, decode_tokens_per_s=1, dram_load_gbps=1,
                               prefill_base_s=base, prefill_attn_s=attn)  # fmt: skip
            loads = []
            for r in ttft:
                blocks = int(r.get("loaded_blocks", 0))
                if blocks:
                    cached = blocks * _block_tokens(r)
                    rest = int(r["prompt_tokens"]) - cached
                    loads.append(
                        (blocks * block_bytes, float(r["ttft_kvfabric_s"]) - cal0.prefill_s(rest, cached))
                    )
            memcpy = [float(r["memcpy_gbps"]) for r in rows if "memcpy_gbps" in r]
            if loads:
                fixed, gbps = fit_load(loads, statistics.median(memcpy) if memcpy else None)
                found["load_fixed_s"], found["dram_load_gbps"] = fixed, gbps
    reads = [r for r in rows if r.get("case") == "cross-process" and r.get("op") == "read" and "gbps" in r]
    if reads and "dram_load_gbps" not in found:
        top = max(int(r["nbytes"]) for r in reads)
        found["dram_load_gbps"] = statistics.median(
            float(r["gbps"]) for r in reads if int(r["nbytes"]) == top
        )
        sources.append(f"bench copy cross-process reads of {top} B")
    posix = [
        float(r["gbps"]) for r in rows if r.get("store") == "posix" and r.get("op") == "load" and "gbps" in r
    ]
    if posix:
        found["ssd_load_gbps"] = statistics.median(posix)
        sources.append(f"bench store posix loads ({len(posix)} rows)")
    rpc = [float(r["rpc_p50_us_spin"]) for r in rows if "rpc_p50_us_spin" in r]
    if rpc:
        found["lookup_rpc_s"] = min(rpc) * 1e-6
        sources.append("bench rpc")
    over = list(overrides)
    if over:
        sources.append("given: " + ", ".join(o.partition("=")[0] for o in over))
    found["source"] = "; ".join(sources)
    missing = {
        "prefill_tokens_per_s": "bench e2e",
        "dram_load_gbps": "bench e2e (its ttft and delegator rows) or bench copy",
        "decode_tokens_per_s": "no bench here; give it as decode_tokens_per_s=N",
    }
    given = {o.partition("=")[0].strip() for o in over}
    for key, where in missing.items():
        if key not in found and key not in given:
            raise ValueError(f"sim calibration {key} is neither in the rows nor given (from: {where})")
    return load_calibration(data=found, flags=over)


def _block_tokens(row: Mapping[str, Any]) -> int:
    return int(row.get("block_tokens", 32))  # bench e2e's engines use 32-token blocks


__all__ = ["calibrate", "fit_load", "fit_prefill", "load_gbps", "read_rows"]
