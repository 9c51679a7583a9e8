"""``kvfabric sim validate``: the simulator's prediction against a real vLLM engine.

Contract: :func:`run` starts one CPU vLLM engine with kvfabric's connector the way ``kvfabric
bench e2e`` does (``harness/engine.py``'s ``make_engine``, SmolLM2-135M unless given another model, 32-token
blocks, vLLM's own prefix cache off), on the ``pool`` store alone with an embedded pool
small enough that the trace makes it evict, and sends it, one request at a time:

1. a warm-up request, then the trace: prompts that share one of a few prefixes (Zipf
   popularity) and add a suffix of their own. After each request it waits for the
   request's dumps, so the pool holds what the simulator's first-token store step assumes,
   and then for the pool's next recency tick, so the next request's blocks are stamped
   later (the replay's order; within one 0.1 s tick the pool's order is its slots');
2. spread over the trace (so they see the machine as the trace does, on a machine shared
   with other work), calibration probes: prompts of several lengths, each sent cold and
   at once again warm (loaded from the pool), and at the end one decode of 16 tokens.
   They give this run's calibration (``calibrate.py``'s prefill fit over the median cold
   TTFT per length; loads at this machine's memcpy rate plus a fixed cost per loading
   request, the median of what the warm probes took beyond that and their prefill;
   decode tokens/s), from other prompts than the trace's.

The simulator then replays the same request sequence (calibration requests included, as
they filled the pool too) on one node with one engine whose DRAM tier is the pool's
size, keyed by kvfabric's block ids of the token ids, and each trace request's predicted
hits and TTFT are compared with the measured ones: the loaded blocks the connector
reports over the blocks a lookup may claim, and the wall time to the first token.
Requests arrive far apart in both, so neither queues.

Rows: one ``validate`` row (``predicted_hit_rate``, ``measured_hit_rate``,
``predicted_ttft_p50_s``, ``measured_ttft_p50_s``, the differences and whether they meet
the targets: 5 points, 25 %), one ``calibration`` row. With ``out_dir`` the trace (JSONL
of token ids, replayable by ``kvfabric sim --trace``), the calibration (YAML) and the
cluster (YAML) are written there.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvfabric.bench.cpuload import CpuMeter
from kvfabric.simulate.calibrate import fit_prefill
from kvfabric.simulate.config import Calibration, ClusterConfig, Routing, save_calibration
from kvfabric.simulate.replay import simulate
from kvfabric.simulate.trace import Request, parse_line

BLOCK = 32  #: harness/engine.py's block size
HIT_POINTS = 0.05
TTFT_REL = 0.25


@dataclass(frozen=True)
class Plan:
    """The sizes of one validation run."""

    requests: int
    prefixes: int
    prefix_tokens: int
    suffix_lo: int
    suffix_hi: int
    pool_blocks: int  #: pool capacity in blocks of the engine's KV
    calib_lengths: tuple[int, ...] = (160, 480, 960)
    probe_rounds: int = 2  #: cold + warm probes per length, spread over the trace
    zipf_s: float = 1.0
    seed: int = 11


QUICK = Plan(requests=24, prefixes=5, prefix_tokens=520, suffix_lo=40, suffix_hi=260, pool_blocks=96)
FULL = Plan(requests=48, prefixes=8, prefix_tokens=768, suffix_lo=40, suffix_hi=320, pool_blocks=160)


TOKEN_LOW, TOKEN_HIGH = 100, 40000  #: token ids drawn: above special tokens, inside SmolLM2's vocabulary


def token_high(model: str | os.PathLike[str]) -> int:
    """The bound of the token ids drawn for ``model``: TOKEN_HIGH, or its vocabulary size
    when smaller (the tiny model's 512)."""
    with open(Path(model) / "config.json") as f:
        vocab = int(json.load(f)["vocab_size"])
    if vocab <= TOKEN_LOW + 1:
        raise ValueError(f"{model}: a vocabulary of {vocab} tokens leaves no ids above {TOKEN_LOW}")
    return min(TOKEN_HIGH, vocab)


def _prompts(plan: Plan, high: int = TOKEN_HIGH) -> list[list[int]]:
    rng = np.random.default_rng(plan.seed)
    prefixes = [rng.integers(TOKEN_LOW, high, plan.prefix_tokens).tolist() for _ in range(plan.prefixes)]
    w = np.arange(1, plan.prefixes + 1, dtype=float) ** -plan.zipf_s
    which = rng.choice(plan.prefixes, plan.requests, p=w / w.sum())
    out = []
    for p in which:
        n = int(rng.integers(plan.suffix_lo, plan.suffix_hi + 1))
        out.append(prefixes[int(p)] + rng.integers(TOKEN_LOW, high, n).tolist())
    return out


def _memcpy_gbps(nbytes: int = 256 << 20) -> float:
    """This machine's host copy rate (best of 3 copies of ``nbytes`` between touched
    buffers): the bound on a pool load's bandwidth."""
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def _calibration(
    cold: dict[int, list[float]],
    warm: list[tuple[int, int, float]],
    block_bytes: int,
    decode_tps: float,
    model: str,
) -> tuple[Calibration, float]:
    """This run's calibration from its probes (``cold``: TTFTs per prompt length; ``warm``:
    (prompt tokens, loaded blocks, TTFT)) and the memcpy rate it charges loads at."""
    base, tps, attn = fit_prefill([(n, 0, statistics.median(v)) for n, v in cold.items() if v])
    cal0 = Calibration(
        prefill_tokens_per_s=tps, decode_tokens_per_s=decode_tps, dram_load_gbps=1.0,
        prefill_base_s=base, prefill_attn_s=attn,
    )  # fmt: skip
    loads = [(k * block_bytes, t - cal0.prefill_s(n - k * BLOCK, k * BLOCK)) for n, k, t in warm if k]
    if not loads:
        raise RuntimeError("no warm calibration probe loaded a block from the pool")
    # a load of tens of MB is a few ms at memory speed, below what TTFTs of whole engine
    # steps resolve: the bytes go at this machine's memcpy rate, and what the warm probes
    # took beyond that and their prefill is the fixed cost of a loading request (the
    # engine steps an asynchronous load adds)
    gbps = _memcpy_gbps()
    fixed_s = max(0.0, statistics.median(dt - nb / (gbps * 1e9) for nb, dt in loads))
    cal = Calibration(
        prefill_tokens_per_s=tps,
        decode_tokens_per_s=decode_tps,
        dram_load_gbps=gbps,
        load_fixed_s=fixed_s,
        prefill_base_s=base,
        prefill_attn_s=attn,
        source=f"kvfabric sim validate: {Path(model).name}, CPU vLLM, embedded pool, this run",
    )
    return cal, gbps


def _write_out(
    out_dir: str | os.PathLike[str],
    name: str,
    lines: list[dict[str, Any]],
    cal: Calibration,
    cluster: ClusterConfig,
) -> None:
    """The run's trace (``<name>-trace.jsonl``, token ids, replayable by ``kvfabric sim
    --trace``), its calibration (``calibration.yaml``) and cluster (``<name>-cluster.yaml``)."""
    import yaml

    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    with open(d / f"{name}-trace.jsonl", "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
    save_calibration(cal, d / "calibration.yaml")
    with open(d / f"{name}-cluster.yaml", "w") as f:
        yaml.safe_dump({k: v for k, v in cluster.as_mapping().items() if k != "price"}, f, sort_keys=False)


def _one_request(eng: Any, w: Any, prompt: list[int], out: int) -> tuple[float, int]:
    """Serve ``prompt`` alone on ``eng`` (``out`` tokens), wait for its dumps and the pool's
    next tick: its wall time to the end and the blocks the connector ``w`` loaded for it."""
    before = w.stats.totals["loaded_blocks"]
    t0 = time.perf_counter()
    eng.generate([prompt], max_tokens=out)
    dt = time.perf_counter() - t0
    eng.flush()
    _next_tick()
    return dt, w.stats.totals["loaded_blocks"] - before


def decode_rate(
    send: Callable[[list[int], int], tuple[float, int]], prompt: list[int], tries: int = 3
) -> float:
    """Decode tokens/s from ``prompt`` served with 1 and with 17 output tokens through
    ``send`` (wall time, blocks loaded). Both must find the prompt in the same state: it is
    served once first (the pool may have evicted it, and a cold 1-token request against a
    warm 17-token one once gave a negative difference), the pair must load the same
    blocks, and the longer one must take longer; ``tries`` pairs, then a ``RuntimeError``
    with the times."""
    send(prompt, 1)
    seen = []
    for _ in range(tries):
        t1, l1 = send(prompt, 1)
        t17, l17 = send(prompt, 17)
        seen.append((round(t1, 4), l1, round(t17, 4), l17))
        if l1 == l17 and t17 > t1:
            return 16 / (t17 - t1)
    raise RuntimeError(
        f"decode probe: 17 output tokens were not slower than 1 with the same blocks loaded "
        f"(seconds, blocks loaded: {seen})"
    )


def _next_tick() -> None:
    """Sleep into the pool's next recency tick (``pool/table.py``'s ``now_ticks``, 0.1 s):
    the blocks the next request touches or stores are then stamped later than this one's,
    as the replay orders them, also when requests take less than a tick (the tiny model)."""
    from kvfabric.pool.table import now_ticks

    t = now_ticks()
    while now_ticks() == t:
        time.sleep(0.005)


def _compared(p_hit: float, m_hit: float, p_ttfts: list[float], m_ttfts: list[float]) -> dict[str, Any]:
    """The comparison fields of a ``validate`` row: hit rates and TTFT percentiles, predicted
    and measured, their differences and whether they meet the targets."""
    p_ttft, m_ttft = statistics.median(p_ttfts), statistics.median(m_ttfts)
    rel = abs(p_ttft - m_ttft) / m_ttft
    return {
        "predicted_hit_rate": round(p_hit, 4),
        "measured_hit_rate": round(m_hit, 4),
        "hit_rate_diff_points": round(100 * (p_hit - m_hit), 2),
        "predicted_ttft_p50_s": round(p_ttft, 4),
        "measured_ttft_p50_s": round(m_ttft, 4),
        "ttft_p50_rel_error": round(rel, 3),
        "predicted_ttft_p99_s": round(float(np.percentile(p_ttfts, 99)), 4),
        "measured_ttft_p99_s": round(float(np.percentile(m_ttfts, 99)), 4),
        "hit_within_5_points": abs(p_hit - m_hit) <= HIT_POINTS,
        "ttft_within_25_percent": rel <= TTFT_REL,
    }


def _run_facts(
    cold: dict[int, list[float]],
    warm: list[tuple[int, int, float]],
    gbps: float,
    engine_s: float,
    cpu: dict[str, Any],
) -> dict[str, Any]:
    """What a ``validate`` row says of the run: its probes, memcpy rate, time and load
    (``foreign_cores``: cores' worth of CPU other processes used while the engine ran,
    ``bench.cpuload.CpuMeter``; the prediction cannot see that work)."""
    return {
        "engine_s": round(engine_s, 1),
        "foreign_cores": cpu["foreign_cores"],
        "probes_cold_s": {str(n): [round(t, 3) for t in v] for n, v in cold.items()},
        "probes_warm": [[n, k, round(t, 3)] for n, k, t in warm],  # prompt tokens, loaded blocks, TTFT
        "memcpy_gbps": round(gbps, 2),
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "ncpu": os.cpu_count(),
    }


def _calibration_row(cal: Calibration) -> dict[str, Any]:
    return {
        "case": "calibration",
        **{k: (round(v, 9) if isinstance(v, float) else v) for k, v in asdict(cal).items()},
    }


def run(
    quick: bool = True,
    out_dir: str | os.PathLike[str] | None = None,
    *,
    plan: Plan | None = None,
    model: str | os.PathLike[str] | None = None,
) -> Iterator[dict[str, Any]]:
    """Measure, replay and compare (module docstring); yields the rows. ``plan`` (default
    :data:`QUICK` or :data:`FULL` by ``quick``) and ``model`` (a model directory; default
    SmolLM2-135M) replace the presets, e.g. a smaller trace on the tiny model for a test."""
    from kvfabric.bench.serve_worker import kv_bytes_per_token
    from kvfabric.harness.engine import kvfabric_transfer_config, make_engine, vllm_problem
    from kvfabric.harness.models import smollm2

    problem = vllm_problem()
    if problem:
        raise ImportError(f"kvfabric sim validate needs vLLM: {problem}")
    if plan is None:
        plan = QUICK if quick else FULL
    model = str(smollm2() if model is None else model)
    high = token_high(model)
    rng = np.random.default_rng(plan.seed + 1)
    seq: list[tuple[list[int], int]] = []  # every request the engine saw: (prompt, output tokens)
    measured: list[tuple[float, int, int]] = []  # trace requests: (ttft, loaded, claimable)

    # the pool is sized before the engine starts, in blocks of the model's float32 KV (K and V
    # of every layer); the bytes per block the connector actually stores are read back below
    block_bytes = kv_bytes_per_token(model) * BLOCK
    pool_bytes = plan.pool_blocks * block_bytes
    transfer = kvfabric_transfer_config(
        "pool", pool_bytes=pool_bytes, store_options={"pool.name": "kvf-sim-validate"}
    )
    t_start, meter = time.perf_counter(), CpuMeter().start()
    eng = make_engine(model, transfer, kv_bytes=512 << 20, max_model_len=4096)
    try:
        w = eng.worker()
        if w is None:
            raise RuntimeError("the engine's kvfabric worker connector is not in this process")

        def send(prompt: list[int], out: int = 1) -> tuple[float, int]:
            seq.append((prompt, out))
            return _one_request(eng, w, prompt, out)

        send(rng.integers(TOKEN_LOW, high, 64).tolist())  # warm-up: one-time costs
        trace = _prompts(plan, high)
        probes = [n for n in plan.calib_lengths for _ in range(plan.probe_rounds)]
        every = max(1, len(trace) // len(probes))
        cold: dict[int, list[float]] = {n: [] for n in plan.calib_lengths}
        warm: list[tuple[int, int, float]] = []
        trace_at: list[int] = []  # positions in seq of the trace's requests
        for i, prompt in enumerate(trace):
            if i % every == 0 and probes:  # a calibration probe: cold, then at once warm
                n = probes.pop(0)
                p = rng.integers(TOKEN_LOW, high, n).tolist()
                cold[n].append(send(p)[0])
                t, loaded = send(p)
                warm.append((n, loaded, t))
            trace_at.append(len(seq))
            t, loaded = send(prompt)
            measured.append((t, loaded, max(len(prompt) - 1, 0) // BLOCK))
        saved = w.stats.totals["saved_bytes"] // max(1, w.stats.totals["saved_blocks"])
        if saved and saved != block_bytes:  # the pool stays as sized; the blocks are what was stored
            block_bytes = int(saved)
        cal, gbps = _calibration(cold, warm, block_bytes, decode_rate(send, p), model)
    finally:
        eng.close()
    engine_s, cpu = time.perf_counter() - t_start, meter.stop()

    cluster = ClusterConfig(
        nodes=1,
        engines_per_node=1,
        block_tokens=BLOCK,
        kv_bytes_per_token=block_bytes // BLOCK,
        hbm_bytes=0,
        dram_bytes=pool_bytes,
        ssd_bytes=0,
        routing=Routing.ROUND_ROBIN,
    )
    reqs = [
        parse_line({"arrival_s": 1000.0 * i, "tokens": p, "output_tokens": o}, f"request {i}", BLOCK, None)
        for i, (p, o) in enumerate(seq)
    ]
    predicted: list[tuple[float, int, int]] = []

    def record(req: Request, ttft: float, hit: int, claim: int) -> None:
        predicted.append((ttft, hit, claim))

    rep = simulate(cluster, cal, reqs, on_first_token=record)
    pred = [predicted[i] for i in trace_at]
    p_hit = sum(h for _, h, _ in pred) / max(1, sum(c for _, _, c in pred))
    m_hit = sum(h for _, h, _ in measured) / max(1, sum(c for _, _, c in measured))
    if out_dir is not None:
        lines = [{"arrival_s": r.arrival_s, "tokens": p, "output_tokens": o} for r, (p, o) in zip(reqs, seq)]
        _write_out(out_dir, "validate", lines, cal, cluster)
    yield {
        "case": "validate",
        "quick": quick,
        "requests": len(measured),
        **_compared(p_hit, m_hit, [t for t, _, _ in pred], [t for t, _, _ in measured]),
        "pool_bytes": pool_bytes,
        "block_bytes": block_bytes,
        "predicted_evictions": rep.evictions["dram"],
        **_run_facts(cold, warm, gbps, engine_s, cpu),
    }
    yield _calibration_row(cal)


SERVE_SEED = 505  #: seed of the serve workload's prompts and arrivals here (bench serve's are its own)


def run_serve(
    quick: bool = True,
    out_dir: str | os.PathLike[str] | None = None,
    *,
    model: str | os.PathLike[str] | None = None,
) -> Iterator[dict[str, Any]]:
    """``kvfabric sim validate --workload serve``: ``kvfabric bench serve``'s workload
    (``bench/serve_workload.py``: its preset, quick or full, and its generator: shared
    prefixes, each reused by ``requests_per_prefix`` requests with questions of their own,
    in a seeded order, Poisson arrivals at an exact rate), served the way the bench serves a
    phase (``bench/serve_worker.py``'s ``serve_phase``: requests added at their arrival
    times, the engine stepped, so requests overlap and vLLM batches them), then replayed.

    One engine as :func:`run` starts it (vLLM's prefix cache off, the ``pool`` store alone,
    an embedded pool of the bench daemon's size, four working sets: no eviction). Just
    before the workload, one request at a time: a warm-up and calibration probes (cold and
    at once warm, ``probe_rounds`` per length, lengths up to a workload prompt's) and the
    decode probe; the offered rate is the preset's ``rate_fraction`` of the rate at which
    this calibration serves cold requests back to back (the bench takes it of vLLM alone's
    measured saturation rate). Hit rate is in prompt tokens, as the bench reports it:
    ``num_cached_tokens`` (all the connector's, vLLM's cache being off) over prompt tokens,
    and the replay's hit blocks times the block size over the same. Rows: ``validate`` with
    ``workload: serve`` and ``calibration``; ``out_dir`` as in :func:`run` (``serve-*``)."""
    from kvfabric.bench.serve_worker import kv_bytes_per_token, serve_phase
    from kvfabric.bench.serve_workload import FULL as SERVE_FULL
    from kvfabric.bench.serve_workload import QUICK as SERVE_QUICK
    from kvfabric.bench.serve_workload import make_workload
    from kvfabric.harness.engine import kvfabric_transfer_config, make_engine, vllm_problem
    from kvfabric.harness.models import smollm2

    problem = vllm_problem()
    if problem:
        raise ImportError(f"kvfabric sim validate needs vLLM: {problem}")
    preset = SERVE_QUICK if quick else SERVE_FULL
    model = str(smollm2() if model is None else model)
    high = token_high(model)
    bpt = kv_bytes_per_token(model)
    block_bytes = bpt * BLOCK
    prompt_len = preset.prefix_tokens + preset.question_tokens
    lengths = sorted({max(BLOCK + 1, prompt_len // 4), prompt_len // 2, prompt_len})
    rounds = 3
    pool_bytes = 4 * preset.working_set_tokens * bpt + rounds * sum(lengths) * bpt
    transfer = kvfabric_transfer_config(
        "pool", pool_bytes=pool_bytes, store_options={"pool.name": "kvf-sim-validate-serve"}
    )
    rng = np.random.default_rng(SERVE_SEED)
    seq: list[tuple[list[int], int, float | None]] = []  # (prompt, output tokens, arrival offset)
    t_start, meter = time.perf_counter(), CpuMeter().start()
    eng = make_engine(model, transfer, kv_bytes=512 << 20, max_model_len=max(4096, preset.max_model_len))
    try:
        w = eng.worker()
        if w is None:
            raise RuntimeError("the engine's kvfabric worker connector is not in this process")

        def send(prompt: list[int], out: int = 1) -> tuple[float, int]:
            seq.append((prompt, out, None))
            return _one_request(eng, w, prompt, out)

        send(rng.integers(TOKEN_LOW, high, 64).tolist())  # warm-up: one-time costs
        cold: dict[int, list[float]] = {n: [] for n in lengths}
        warm: list[tuple[int, int, float]] = []
        for _ in range(rounds):
            for n in lengths:
                p = rng.integers(TOKEN_LOW, high, n).tolist()
                cold[n].append(send(p)[0])
                t, loaded = send(p)
                warm.append((n, loaded, t))
        cal, gbps = _calibration(cold, warm, block_bytes, decode_rate(send, p), model)
        cold_s = cal.prefill_s(prompt_len, 0) + preset.output_tokens / cal.decode_tokens_per_s
        qps = preset.rate_fraction / cold_s
        work = make_workload(preset, SERVE_SEED, qps)
        if any(max(r.prompt) >= high for r in work):
            raise ValueError(f"{model}: the serve workload's token ids exceed its vocabulary ({high})")
        records, wall = serve_phase(eng.llm, work, preset.output_tokens)
        eng.flush()
        seq += [(list(r.prompt), preset.output_tokens, r.arrival_s) for r in work]
    finally:
        eng.close()
    engine_s, cpu = time.perf_counter() - t_start, meter.stop()

    cluster = ClusterConfig(
        nodes=1, engines_per_node=1, block_tokens=BLOCK, kv_bytes_per_token=bpt,
        hbm_bytes=0, dram_bytes=pool_bytes, ssd_bytes=0, routing=Routing.ROUND_ROBIN,
    )  # fmt: skip
    t_work = 1000.0 * (len(seq) + 1)  # the workload starts long after the probes
    arrivals = [1000.0 * i if a is None else t_work + a for i, (_, _, a) in enumerate(seq)]
    reqs = [
        parse_line({"arrival_s": t, "tokens": p, "output_tokens": o}, f"request {i}", BLOCK, None)
        for i, (t, (p, o, _)) in enumerate(zip(arrivals, seq))
    ]
    first: dict[int, tuple[float, int]] = {}

    def record(req: Request, ttft: float, hit: int, claim: int) -> None:
        first[id(req)] = (ttft, hit)

    rep = simulate(cluster, cal, reqs, on_first_token=record)
    pred = [first[id(r)] for r in reqs[len(reqs) - len(work) :]]
    prompt_tokens = sum(r.prompt_tokens for r in records)
    p_hit = sum(h * BLOCK for _, h in pred) / prompt_tokens
    m_hit = sum(r.cached_tokens for r in records) / prompt_tokens
    if out_dir is not None:
        lines = [{"arrival_s": t, "tokens": p, "output_tokens": o} for t, (p, o, _) in zip(arrivals, seq)]
        _write_out(out_dir, "serve", lines, cal, cluster)
    yield {
        "case": "validate",
        "workload": "serve",
        "preset": preset.name,
        "quick": quick,
        "requests": len(records),
        "qps": round(qps, 4),
        **_compared(p_hit, m_hit, [t for t, _ in pred], [r.ttft_s for r in records]),
        "measured_wall_s": round(wall, 3),
        "pool_bytes": pool_bytes,
        "block_bytes": block_bytes,
        "predicted_evictions": rep.evictions["dram"],
        **_run_facts(cold, warm, gbps, engine_s, cpu),
    }
    yield _calibration_row(cal)


__all__ = ["FULL", "QUICK", "SERVE_SEED", "Plan", "run", "run_serve"]
