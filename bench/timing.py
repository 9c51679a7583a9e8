"""Interleaved timing of an operation and its baseline, with per-call percentiles.

Each round alternates call by call between ``ours`` and ``base`` (A B A B ..., so both
see the same moment's machine load); figures are medians over rounds of the mean time
per call, percentiles over every call.
The CPU busy fraction over the measurement tells whether the other cores were busy.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvfabric.bench.report import cpu_busy_fraction, read_cpu_row


@dataclass(frozen=True)
class Timing:
    ours_s: float  # median seconds per call
    base_s: float
    p50_us: float
    p99_us: float
    base_p50_us: float
    cpu_busy: float  # system-wide busy fraction during the measurement


def _timed(f: Callable[[], Any], calls: list[float]) -> float:
    """Seconds one call of ``f`` took, also appended to ``calls``."""
    t0 = time.perf_counter()
    f()
    dt = time.perf_counter() - t0
    calls.append(dt)
    return dt


def measure(ours: Sequence[Callable[[], Any]], base: Sequence[Callable[[], Any]], rounds: int) -> Timing:
    for f in (*ours[:2], *base[:2]):  # warm the call paths
        f()
    a_rounds, b_rounds, a_calls, b_calls = [], [], [], []
    row0 = read_cpu_row()
    n = max(len(ours), len(base))
    for _ in range(rounds):
        ta = tb = 0.0
        for i in range(n):  # call by call: A B A B, so both see the same moment's load
            if i < len(ours):
                ta += _timed(ours[i], a_calls)
            if i < len(base):
                tb += _timed(base[i], b_calls)
        a_rounds.append(ta / len(ours))
        b_rounds.append(tb / len(base))
    busy = cpu_busy_fraction((row0, read_cpu_row()))
    a = np.array(a_calls) * 1e6
    b = np.array(b_calls) * 1e6
    return Timing(
        statistics.median(a_rounds),
        statistics.median(b_rounds),
        float(np.percentile(a, 50)),
        float(np.percentile(a, 99)),
        float(np.percentile(b, 50)),
        busy,
    )


def load_note(busy: float) -> dict[str, Any]:
    """Whether cores other than the measuring one were busy (our own process fills one)."""
    n = os.cpu_count() or 1
    others = max(busy * n - 1.0, 0.0) / max(n - 1, 1)
    return {"cpu_busy": round(busy, 2), "other_cores": "busy" if others > 0.3 else "idle"}
