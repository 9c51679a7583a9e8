"""The pure parts of ``kvfabric bench serve``: presets, the prefix-reuse workload, the
statistics of a run and the row schema. No engine, no process, no clock.

* :class:`Preset`: how many shared prefixes, how long, requests per prefix, question and
  output lengths, vLLM's KV cache in tokens (smaller than the working set, so vLLM's own
  prefix cache cannot hold it), the fraction of vLLM-alone's saturation throughput at which
  the fixed-rate phase offers requests.
* :func:`make_workload`: the requests of one phase: every prefix reused by
  ``requests_per_prefix`` requests, each with its own question, in a seeded random order;
  arrival offsets from a Poisson process at ``qps`` (``None``: all at 0, saturation).
* :func:`percentile`, :func:`phase_stats`: requests/s, output tokens/s, TTFT p50/p90/p99
  and hit rate in tokens of one phase from per-request records.
* :func:`flank_figures`: each run's adjacent baseline figures (the geometric mean of the
  runs right before and after it, in the order :func:`kvfabric.bench.flank.flanked_schedule`
  gives), against which its ratios are taken.
* :func:`add_ratios`: each row's ratios to vLLM alone and to the best peer of its phase.
* :func:`floor_figures`: the warm single-request floor (KV bytes / memcpy bandwidth + the
  engine's time with the prefix resident) and the warm TTFT's ratio to it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from kvfabric.bench.flank import adjacent_means

#: token ids drawn for prompts: above the special tokens, below SmolLM2's vocabulary (49,152)
TOKEN_LOW, TOKEN_HIGH = 100, 40000


class Phase(str, Enum):
    """One workload run of a configuration."""

    RATE = "rate"  # Poisson arrivals at a fixed QPS below vLLM-alone's saturation
    SATURATION = "saturation"  # every request arrives at once
    SECOND_ENGINE = "second_engine"  # another engine process re-serves the first one's prefixes
    WARM_SINGLE = "warm_single"  # one request at a time, its prefix in the connector's store only


class ConfigKind(str, Enum):
    """What a configuration row stands for."""

    BASELINE = "baseline"  # vLLM alone, its own prefix cache on
    KVFABRIC = "kvfabric"
    PEER = "peer"  # a connector users would pick instead


@dataclass(frozen=True)
class Preset:
    """A workload size. ``kv_cache_tokens`` is vLLM's KV cache (its own prefix cache lives
    in it); the working set of one phase is ``prefixes * prefix_tokens``."""

    name: str
    prefixes: int
    prefix_tokens: int
    requests_per_prefix: int
    question_tokens: int
    output_tokens: int
    kv_cache_tokens: int
    rate_fraction: float = 0.6
    floor_rounds: int = 3

    @property
    def requests(self) -> int:
        return self.prefixes * self.requests_per_prefix

    @property
    def working_set_tokens(self) -> int:
        return self.prefixes * self.prefix_tokens

    @property
    def max_model_len(self) -> int:
        """Prompt + output rounded up to whole 32-token blocks."""
        n = self.prefix_tokens + self.question_tokens + self.output_tokens
        return -(-n // 32) * 32


FULL = Preset("full", 4, 512, 5, 32, 8, kv_cache_tokens=1024)
QUICK = Preset("quick", 2, 256, 5, 16, 4, kv_cache_tokens=320, rate_fraction=0.7, floor_rounds=3)


@dataclass(frozen=True)
class Request:
    """One request of a phase: its prompt (``prefix`` + own question) and arrival offset."""

    req_id: str
    prefix_id: int
    prompt: tuple[int, ...]
    arrival_s: float


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(n))


def make_prefixes(preset: Preset, seed: int) -> list[tuple[int, ...]]:
    """The ``preset.prefixes`` shared prefixes of one phase (seeded; distinct seeds give
    prefixes that share no block)."""
    rng = random.Random(seed)
    return [_tokens(rng, preset.prefix_tokens) for _ in range(preset.prefixes)]


def make_workload(
    preset: Preset,
    seed: int,
    qps: float | None,
    prefixes: Sequence[Sequence[int]] | None = None,
    order_seed: int | None = None,
) -> list[Request]:
    """The requests of one phase, sorted by arrival. ``prefixes`` (default: drawn from
    ``seed``) are shared; each request adds a distinct question drawn from ``seed``. The
    order is a shuffle of every (prefix, repeat) pair seeded by ``order_seed`` (default
    ``seed``), so a prefix's reuses are spread over the run; ``qps`` None: every arrival 0;
    else exponential gaps drawn from ``order_seed`` too, the first arrival at 0, scaled so
    that the last is at ``(n - 1) / qps``: the offered rate is ``qps`` exactly.
    Runs with one ``order_seed`` and other ``seed`` s serve prompts of other tokens in the
    same order at the same times: the same reuse pattern for every configuration."""
    if qps is not None and not qps > 0:
        raise ValueError(f"qps must be > 0 or None, got {qps}")
    pre = [tuple(p) for p in prefixes] if prefixes is not None else make_prefixes(preset, seed)
    orng = random.Random((seed if order_seed is None else order_seed) * 7919 + 1)
    qrng = random.Random(seed * 7919 + 2)
    order = [i for i in range(len(pre)) for _ in range(preset.requests_per_prefix)]
    orng.shuffle(order)
    gaps = [orng.expovariate(qps) for _ in order[1:]] if qps is not None else [0.0] * (len(order) - 1)
    if qps is not None and gaps:
        # a few requests' exponential gaps can sum far from their mean: scale them so the
        # phase offers exactly ``qps`` (its last arrival at (n - 1) / qps), the shape kept
        scale = (len(gaps) / qps) / sum(gaps)
        gaps = [g * scale for g in gaps]
    out: list[Request] = []
    t = 0.0
    for k, pid in enumerate(order):
        if k > 0:
            t += gaps[k - 1]
        out.append(Request(f"s{seed}-r{k}", pid, pre[pid] + _tokens(qrng, preset.question_tokens), t))
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between order statistics
    (numpy's default); NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass(frozen=True)
class RequestRecord:
    """What one served request measured: seconds from its arrival to its first token and to
    its end, tokens of its prompt, of them served from a cache (vLLM's
    ``num_cached_tokens``: its own prefix cache plus a connector's), tokens generated."""

    ttft_s: float
    latency_s: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int


def phase_stats(records: Sequence[RequestRecord], wall_s: float) -> dict[str, float]:
    """Figures of one phase: ``wall_s`` from the first arrival to the last request's end;
    ``ttft_p50_hit_s`` / ``ttft_p50_miss_s``: TTFT p50 of the requests with cached tokens
    and of those without (None where there are none)."""
    if not records:
        raise ValueError("phase_stats needs at least one request")
    if not wall_s > 0:
        raise ValueError(f"wall_s must be > 0, got {wall_s}")
    ttft = [r.ttft_s for r in records]
    hit = [r.ttft_s for r in records if r.cached_tokens > 0]
    miss = [r.ttft_s for r in records if r.cached_tokens == 0]
    prompt = sum(r.prompt_tokens for r in records)
    return {
        "requests": len(records),
        "wall_s": round(wall_s, 3),
        "requests_per_s": round(len(records) / wall_s, 4),
        "output_tokens_per_s": round(sum(r.output_tokens for r in records) / wall_s, 2),
        "ttft_p50_s": round(percentile(ttft, 50), 4),
        "ttft_p90_s": round(percentile(ttft, 90), 4),
        "ttft_p99_s": round(percentile(ttft, 99), 4),
        "latency_p50_s": round(percentile([r.latency_s for r in records], 50), 4),
        "hit_rate": round(sum(r.cached_tokens for r in records) / prompt, 4) if prompt else 0.0,
        # the requests that hit a cache (vLLM's own or a connector's) and those that missed
        "requests_hit": len(hit),
        "ttft_p50_hit_s": round(percentile(hit, 50), 4) if hit else None,
        "ttft_p50_miss_s": round(percentile(miss, 50), 4) if miss else None,
        "hit_tokens": sum(r.cached_tokens for r in records),
        "prompt_tokens": prompt,
    }


#: every row of ``kvfabric bench serve`` has these keys (None where a figure is missing)
ROW_KEYS = (
    "config",
    "kind",
    "phase",
    "status",
    "requests_per_s",
    "output_tokens_per_s",
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_p99_s",
    "hit_rate",
    "ratio_ttft_p50_vs_vllm",
    "ratio_requests_per_s_vs_vllm",
    "ratio_vs_best_peer",
    "ratio_requests_per_s_vs_best_peer",
    "best_peer",
)
FIGURES = ("requests_per_s", "output_tokens_per_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "hit_rate")


def make_row(config: str, kind: ConfigKind, phase: Phase | None, **figures: Any) -> dict[str, Any]:
    """A row with every key of :data:`ROW_KEYS` (missing figures None; ``status`` ``ok``
    unless given, e.g. ``error`` with an ``error`` text)."""
    row: dict[str, Any] = dict.fromkeys(ROW_KEYS)
    row.update(config=config, kind=kind.value, phase=phase.value if phase else None, status="ok")
    row.update(figures)
    return row


def _ratio(num: Any, den: Any) -> float | None:
    if not isinstance(num, (int, float)) or not isinstance(den, (int, float)) or not num > 0 or not den > 0:
        return None
    return round(num / den, 3)


#: the figures a run's adjacent baseline is summarized by
FLANK_FIGURES = ("ttft_p50_s", "requests_per_s")


def flank_figures(runs: Sequence[tuple[str, dict[str, Any]]], baseline: str) -> list[dict[str, float] | None]:
    """For each run of ``runs`` (in the order they ran: (config, stats) pairs), the
    baseline's figures next to it in time: for each of :data:`FLANK_FIGURES`, the geometric
    mean of the nearest baseline runs before and after it that have the figure (one side
    alone where the other has none; :func:`~kvfabric.bench.flank.adjacent_means`), keyed
    ``vllm_adjacent_<figure>``. None for a baseline run, and for a run with no such
    baseline run on either side."""
    base = [cfg == baseline for cfg, _ in runs]
    means = {key: adjacent_means(base, [st.get(key) for _, st in runs]) for key in FLANK_FIGURES}
    out: list[dict[str, float] | None] = []
    for i in range(len(runs)):
        figs = {f"vllm_adjacent_{k}": round(m[i], 4) for k, m in means.items() if m[i] is not None}
        out.append(figs if len(figs) == len(FLANK_FIGURES) else None)
    return out


def _baseline_phase(phase: str | None) -> str | None:
    """The vLLM-alone phase a row is compared with: a second engine re-serves the saturation
    phase's prefixes, so it is set against vLLM alone at saturation."""
    return Phase.SATURATION.value if phase == Phase.SECOND_ENGINE.value else phase


def add_ratios(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows with their ratios filled in, per phase. Each ratio is >1 when the row is
    better: ``ratio_ttft_p50_vs_vllm`` = vLLM-alone's TTFT p50 / the row's,
    ``ratio_requests_per_s_vs_vllm`` = the row's requests/s / vLLM-alone's. vLLM alone's
    figures are the row's ``vllm_adjacent_ttft_p50_s`` / ``vllm_adjacent_requests_per_s``
    where it has them (the baseline runs right before and after it, :func:`flank_figures`),
    else the baseline row of its phase. The best peer of a phase is the ``ok`` peer row with
    the highest ``ratio_ttft_p50_vs_vllm`` (``best_peer`` names it); ``ratio_vs_best_peer``
    = the row's ``ratio_ttft_p50_vs_vllm`` / that peer's and
    ``ratio_requests_per_s_vs_best_peer`` likewise, so both sides are taken against their own
    adjacent baseline and the peer's run at another time does not skew it. Rows without
    the figure, or a phase without a baseline or a peer, get None."""
    out = [dict(r) for r in rows]
    ok = [r for r in out if r.get("status") == "ok" and isinstance(r.get("ttft_p50_s"), (int, float))]
    base = {r["phase"]: r for r in ok if r["kind"] == ConfigKind.BASELINE.value}
    for r in out:
        b = base.get(_baseline_phase(r.get("phase")))
        b_ttft = r.get("vllm_adjacent_ttft_p50_s") or (b["ttft_p50_s"] if b else None)
        b_rps = r.get("vllm_adjacent_requests_per_s") or (b["requests_per_s"] if b else None)
        r["ratio_ttft_p50_vs_vllm"] = _ratio(b_ttft, r.get("ttft_p50_s"))
        r["ratio_requests_per_s_vs_vllm"] = _ratio(r.get("requests_per_s"), b_rps)
    peers: dict[str, dict[str, Any]] = {}
    for r in ok:
        if r["kind"] == ConfigKind.PEER.value and r["ratio_ttft_p50_vs_vllm"] is not None:
            cur = peers.get(r["phase"])
            if cur is None or r["ratio_ttft_p50_vs_vllm"] > cur["ratio_ttft_p50_vs_vllm"]:
                peers[r["phase"]] = r
    for r in out:
        p = peers.get(_baseline_phase(r.get("phase")))
        if p is not None:
            r["ratio_vs_best_peer"] = _ratio(r["ratio_ttft_p50_vs_vllm"], p["ratio_ttft_p50_vs_vllm"])
            r["ratio_requests_per_s_vs_best_peer"] = _ratio(
                r["ratio_requests_per_s_vs_vllm"], p["ratio_requests_per_s_vs_vllm"]
            )
            r["best_peer"] = p["config"]
    return out


def floor_figures(
    hit_bytes: int, memcpy_gbps: float, resident_ttft_s: float, warm_ttft_s: float
) -> dict[str, float]:
    """The warm single-request floor: the hit's KV bytes at memcpy bandwidth (GB/s, 1e9)
    plus the engine's time for the uncached suffix and one sample (TTFT with the prefix
    resident in vLLM's cache); ``ratio_warm_ttft_vs_floor`` = warm TTFT / floor."""
    if not memcpy_gbps > 0 or hit_bytes < 0 or not resident_ttft_s > 0:
        raise ValueError(
            f"floor needs memcpy_gbps > 0, hit_bytes >= 0, resident_ttft_s > 0; got "
            f"{memcpy_gbps}, {hit_bytes}, {resident_ttft_s}"
        )
    copy_s = hit_bytes / (memcpy_gbps * 1e9)
    floor = copy_s + resident_ttft_s
    return {
        "hit_bytes": hit_bytes,
        "memcpy_gbps": round(memcpy_gbps, 3),
        "floor_copy_s": round(copy_s, 5),
        "resident_ttft_s": round(resident_ttft_s, 4),
        "ttft_floor_s": round(floor, 4),
        "warm_ttft_s": round(warm_ttft_s, 4),
        "ratio_warm_ttft_vs_floor": round(warm_ttft_s / floor, 3),
    }
