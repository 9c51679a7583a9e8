"""Connector counters, shaped for vLLM's connector stats (a plain, serialisable dict).

Each role keeps a :class:`StatsWindow`; vLLM collects it every step through
``get_kv_connector_stats`` (``take()`` returns the window's data and starts a new one),
adds the workers' windows to the scheduler's (``merge``), and logs ``reduce``'s summary.
``totals`` keeps the counts since start for tests, ``kvfabric demo`` and benchmarks.

Counters: ``lookups``, ``requested_tokens``, ``hit_tokens`` (local + external prefix
the lookups saw), ``external_hit_tokens`` (what kvfabric adds); each lookup's outcome:
``lookup_hits`` (kvfabric added at least one block), ``lookup_misses`` (it was asked for
one or more full blocks and had none), ``lookup_below_block`` (the prompt is shorter than
one block, so it has no block id: counted apart from the misses); ``loaded_blocks``,
``loaded_bytes``, ``load_failed_blocks``, ``saved_blocks``, ``saved_bytes``,
``save_failed_blocks``, ``repair_blocks`` (blocks the scheduler plans to dump again
because a load of them, or of a block before them, failed; see ``scheduler.py``);
latency samples ``load_s`` and ``save_s`` (seconds per batch).
Every failed block is also counted under its reason, ``load_failed_<reason>``: the
store's per-block status in lower case (``missing``, ``failed``, ``timeout``, ...; a
store that checks checksums reports a mismatch as its own status, so it has its own
counter), or ``error`` when the load raised before any block had a status.
"""

from __future__ import annotations

import statistics
import threading
from typing import Any

import numpy as np

from kvfabric.status import BLOCK_STATUSES
from kvfabric.ucm_layer.store.base import BlockStatus

#: reasons a block fails to load: every store status but OK and PENDING, and ``error``
FAILURE_REASONS = (
    *(s.name.lower() for s in BLOCK_STATUSES if s not in (BlockStatus.OK, BlockStatus.PENDING)),
    "error",
)


def failure_reason(status: int) -> str:
    """The reason name of a failed block's store status (``"error"`` for an unknown code)."""
    try:
        name = BlockStatus(status).name.lower()
    except ValueError:
        return "error"
    return name if name in FAILURE_REASONS else "error"


def failure_reasons(status: object) -> dict[str, int]:
    """The failed blocks of a per-block store ``status`` array counted by reason
    (``{"timeout": 2, "failed": 1}``, in the order first seen; OK and PENDING blocks left out;
    ``-1`` reads as ``error``, a transfer that raised before any block had a status)."""
    out: dict[str, int] = {}
    for code in np.asarray(status, np.int64).reshape(-1).tolist():
        if code in (BlockStatus.OK, BlockStatus.PENDING):
            continue
        reason = failure_reason(code)
        out[reason] = out.get(reason, 0) + 1
    return out


def describe_reasons(reasons: dict[str, int]) -> str:
    """``failure_reasons``' counts for a log line: ``"2 timeout, 1 failed"``."""
    return ", ".join(f"{n} {reason}" for reason, n in reasons.items())


def failure_counter(reason: str) -> str:
    """The counter that counts failed loads of ``reason``."""
    if reason not in FAILURE_REASONS:
        raise ValueError(f"unknown load failure reason {reason!r}; known: {', '.join(FAILURE_REASONS)}")
    return f"load_failed_{reason}"


COUNTERS = (
    "lookups",
    "lookup_hits",
    "lookup_misses",
    "lookup_below_block",
    "requested_tokens",
    "hit_tokens",
    "external_hit_tokens",
    "loaded_blocks",
    "loaded_bytes",
    "load_failed_blocks",
    "saved_blocks",
    "saved_bytes",
    "save_failed_blocks",
    "repair_blocks",
    *(failure_counter(r) for r in FAILURE_REASONS),
)
SAMPLES = ("load_s", "save_s")
MAX_SAMPLES = 4096


def empty() -> dict[str, Any]:
    d: dict[str, Any] = dict.fromkeys(COUNTERS, 0)
    for k in SAMPLES:
        d[k] = []
    return d


def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = empty()
    for k in COUNTERS:
        out[k] = int(a.get(k, 0)) + int(b.get(k, 0))
    for k in SAMPLES:
        out[k] = (list(a.get(k, [])) + list(b.get(k, [])))[-MAX_SAMPLES:]
    return out


def is_empty(d: dict[str, Any]) -> bool:
    return not any(d.get(k) for k in COUNTERS) and not any(d.get(k) for k in SAMPLES)


def reduce(d: dict[str, Any]) -> dict[str, int | float]:
    """A summary for vLLM's periodic log line."""
    out: dict[str, int | float] = {k: int(d.get(k, 0)) for k in COUNTERS}
    req = out["requested_tokens"]
    out["hit_rate"] = round(out["hit_tokens"] / req, 4) if req else 0.0
    for k in SAMPLES:
        xs = d.get(k) or []
        out[f"{k}_p50_ms"] = round(statistics.median(xs) * 1e3, 3) if xs else 0.0
    secs = sum(d.get("load_s") or [])
    out["load_GBps"] = round(out["loaded_bytes"] / secs / 1e9, 3) if secs else 0.0
    secs = sum(d.get("save_s") or [])
    out["save_GBps"] = round(out["saved_bytes"] / secs / 1e9, 3) if secs else 0.0
    return out


class StatsWindow:
    """Thread-safe counters for one role; ``take`` hands vLLM the window and resets it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._window = empty()
        self.totals = empty()

    def add(self, **kv: float) -> None:
        with self._lock:
            for k, v in kv.items():
                if k in SAMPLES:
                    for d in (self._window, self.totals):
                        d[k].append(float(v))
                        if len(d[k]) > MAX_SAMPLES:
                            del d[k][: len(d[k]) - MAX_SAMPLES]
                else:
                    self._window[k] += int(v)
                    self.totals[k] += int(v)

    def take(self) -> dict[str, Any] | None:
        with self._lock:
            if is_empty(self._window):
                return None
            out, self._window = self._window, empty()
            return out


class SchedulerStats(StatsWindow):
    def lookup(
        self,
        requested_tokens: int,
        hit_tokens: int,
        external_hit_tokens: int,
        asked_blocks: int,
        full_blocks: int,
    ) -> None:
        """One lookup: ``asked_blocks`` full blocks beyond vLLM's own hit were looked up in the
        store, of the prompt's ``full_blocks``."""
        outcome = (
            "lookup_below_block"
            if full_blocks == 0
            else "lookup_hits"
            if external_hit_tokens
            else "lookup_misses"
            if asked_blocks
            else None
        )
        extra = {outcome: 1} if outcome else {}
        self.add(
            lookups=1,
            requested_tokens=requested_tokens,
            hit_tokens=hit_tokens,
            external_hit_tokens=external_hit_tokens,
            **extra,
        )
