"""One configuration of ``kvfabric bench serve`` in a process of its own.

``python -m kvfabric.bench.serve_worker SPEC.json OUT_DIR``: reads the spec (written by
``bench/serve.py``: the configuration's ``kv_transfer_config`` or None, the preset, whether
to trace the connector's spans) and builds one in-process vLLM engine on CPU
(SmolLM2-135M-Instruct, float32, eager, 32-token blocks, vLLM's own prefix cache on, a KV
cache of ``kv_cache_tokens``). The engine lives for the whole run: the parent sends it one
command at a time on stdin (a phase with its seeds and arrival rate, or the warm
single-request floor), so configurations take turns phase by phase, and reads each answer
(per-request records as JSON) from a file; see :func:`main`. A phase is driven through
``LLMEngine.add_request`` / ``step``: a request is added once its arrival time has passed,
and its TTFT is counted from its arrival, not from when the loop got to it. Progress lines
go to stderr.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import asdict, replace
from typing import Any

from kvfabric.bench.serve_workload import (
    Preset,
    RequestRecord,
    make_prefixes,
    make_workload,
    phase_stats,
)

BLOCK_SIZE = 32
TOKEN_PAD = 50  # the short requests that step the engine: ids below every prompt's


def _say(config: str, msg: str) -> None:
    print(f"[serve {config}] {msg}", file=sys.stderr, flush=True)


def kv_bytes_per_token(model: str) -> int:
    """KV bytes one token takes in a float32 cache of ``model`` (K and V of every layer)."""
    with open(os.path.join(model, "config.json")) as f:
        c = json.load(f)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return int(c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * head_dim * 4)


def build_engine(model: str, transfer: dict[str, Any] | None, kv_bytes: int, max_model_len: int) -> Any:
    """An in-process vLLM ``LLM`` as ``harness/engine.py`` builds one, with vLLM's prefix
    cache on (as users run it)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kwargs: dict[str, Any] = {}
    if transfer is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(**transfer)
    return LLM(
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        block_size=BLOCK_SIZE,
        kv_cache_memory_bytes=kv_bytes,
        enable_prefix_caching=True,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_model_len,
        seed=0,
        **kwargs,
    )


def _params(max_tokens: int) -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def serve_phase(llm: Any, requests: list[Any], output_tokens: int) -> tuple[list[RequestRecord], float]:
    """Serve ``requests`` (sorted by arrival offset) from now; the records and the wall
    seconds from the first arrival to the last end."""
    eng = llm.llm_engine
    sp = _params(output_tokens)
    t0 = time.perf_counter()
    pending = list(requests)
    arrival: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, RequestRecord] = {}
    while pending or eng.has_unfinished_requests():
        now = time.perf_counter()
        while pending and now - t0 >= pending[0].arrival_s:
            r = pending.pop(0)
            arrival[r.req_id] = t0 + r.arrival_s
            eng.add_request(r.req_id, {"prompt_token_ids": list(r.prompt)}, sp)
        if not eng.has_unfinished_requests():
            time.sleep(max(0.0, min(0.05, t0 + pending[0].arrival_s - time.perf_counter())))
            continue
        for out in eng.step():
            t = time.perf_counter()
            rid = out.request_id
            if rid not in first and out.outputs and out.outputs[0].token_ids:
                first[rid] = t
            if out.finished:
                done[rid] = RequestRecord(
                    ttft_s=first.get(rid, t) - arrival[rid],
                    latency_s=t - arrival[rid],
                    prompt_tokens=len(out.prompt_token_ids or []),
                    cached_tokens=int(out.num_cached_tokens or 0),
                    output_tokens=len(out.outputs[0].token_ids),
                )
    wall = max(arrival[k] + done[k].latency_s for k in done) - t0
    return [done[r.req_id] for r in requests], wall


def _one(llm: Any, prompt: list[int]) -> tuple[float, int]:
    """TTFT of one request served alone, and its cached prompt tokens."""
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], _params(1), use_tqdm=False)[0]
    return time.perf_counter() - t0, int(out.num_cached_tokens or 0)


def _flush() -> None:
    """Wait until every dump a kvfabric connector in this process issued is stored."""
    from kvfabric.ucm_layer.connector.connector import instances

    for c in instances():
        if c.worker is not None and c.worker.layout is not None:
            c.worker._reap(block=True)


def _reset_prefix_cache(llm: Any) -> bool:
    """Empty vLLM's own prefix cache (the connector's store stays); retried while blocks of
    finished requests are still held for their dumps (a short request steps the engine
    between tries)."""
    deadline = time.perf_counter() + 20
    while time.perf_counter() < deadline:
        if llm.reset_prefix_cache():
            return True
        # a connector reports finished dumps (and vLLM frees their blocks) only in a step
        _one(llm, list(range(TOKEN_PAD, TOKEN_PAD + 8)))
        time.sleep(0.05)
    return False


def memcpy_gbps(nbytes: int, rounds: int = 5) -> float:
    """Single-thread memcpy bandwidth (GB/s) of ``nbytes`` between two pre-touched
    buffers, the median of ``rounds``."""
    import numpy as np

    src = np.ones(max(nbytes, 1 << 20), np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return src.nbytes / statistics.median(times) / 1e9


def _span_sums(spans: list[Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in spans:
        if s.end_time is None or s.start_time is None:
            continue
        key = s.name.removeprefix("kvfabric.")
        out[key] = out.get(key, 0.0) + (s.end_time - s.start_time) / 1e9
    return out


def warm_floor(llm: Any, preset: Preset, seed: int, exporter: Any, model: str) -> dict[str, Any]:
    """Warm single-request TTFT through the connector (vLLM's prefix cache emptied before
    each round) next to the same prefix resident in vLLM's cache, the hit's bytes, memcpy
    of them in this process, and the connector's spans of the warm requests."""
    prefix = list(make_prefixes(preset, seed)[0])
    n = 2 * (preset.floor_rounds + 1) + 1
    qs = make_workload(replace(preset, requests_per_prefix=n), seed + 1, None, [prefix])
    qi = iter([list(r.prompt) for r in qs])  # distinct questions after the one prefix
    _one(llm, next(qi))  # cold: the connector stores the prefix
    time.sleep(0.3)
    _flush()
    warm, resident, hits, parts = [], [], [], []
    for _ in range(preset.floor_rounds + 1):  # the first round is unmeasured (pages fault in)
        if not _reset_prefix_cache(llm):
            raise RuntimeError("vLLM's prefix cache could not be reset (blocks still in use)")
        if exporter is not None:
            exporter.clear()
        tw, hw = _one(llm, next(qi))
        spans = list(exporter.get_finished_spans()) if exporter is not None else []
        tr, _ = _one(llm, next(qi))  # the prefix is now resident in vLLM's own cache
        warm.append(tw)
        resident.append(tr)
        hits.append(hw)
        parts.append(_span_sums(spans))
        _flush()
    warm, resident, hits, parts = warm[1:], resident[1:], hits[1:], parts[1:]
    hit_tokens = min(hits)
    hit_bytes = hit_tokens * kv_bytes_per_token(model)
    keys = sorted({k for p in parts for k in p})
    return {
        "warm_ttft_s": statistics.median(warm),
        "resident_ttft_s": statistics.median(resident),
        "hit_tokens": hit_tokens,
        "hit_bytes": hit_bytes,
        "memcpy_gbps": memcpy_gbps(hit_bytes),
        "spans_s": {k: statistics.median(p.get(k, 0.0) for p in parts) for k in keys},
        "rounds": len(warm),
    }


def _run_phase(llm: Any, preset: Preset, config: str, cmd: dict[str, Any], exporter: Any) -> dict[str, Any]:
    """One ``phase`` command: its requests served from now, the stats and the records;
    with ``exporter`` (the connector's spans traced), of the spans that began in the phase:
    the seconds they took summed by name (``spans_s``: each ``kvfabric.`` span over all of
    the phase's requests), their counts, medians and maxima (``span_counts``,
    ``span_p50_s``, ``span_max_s``)."""
    if exporter is not None:
        exporter.clear()
    t0_ns = time.time_ns()
    qps = cmd["qps"]
    prefixes = make_prefixes(preset, cmd["prefix_seed"])
    reqs = make_workload(preset, cmd["seed"], qps, prefixes, cmd.get("order_seed"))
    _say(config, f"phase {cmd['phase']}: {len(reqs)} requests, qps {round(qps, 3) if qps else 'all at once'}")
    records, wall = serve_phase(llm, reqs, preset.output_tokens)
    stats = phase_stats(records, wall)
    _say(config, f"phase {cmd['phase']}: {stats}")
    time.sleep(0.3)
    _flush()
    out = {"phase": cmd["phase"], "qps": qps, "stats": stats, "records": [asdict(r) for r in records]}
    if exporter is not None:
        # spans that began in this phase (a dump of an earlier request that ends now is not its)
        spans = [sp for sp in exporter.get_finished_spans() if (sp.start_time or 0) >= t0_ns]
        out["spans_s"] = {k: round(v, 4) for k, v in _span_sums(spans).items()}
        durs: dict[str, list[float]] = {}
        for sp in spans:
            if sp.end_time is not None and sp.start_time is not None:
                durs.setdefault(sp.name.removeprefix("kvfabric."), []).append(
                    (sp.end_time - sp.start_time) / 1e9
                )
        out["span_counts"] = {k: len(v) for k, v in durs.items()}
        out["span_p50_s"] = {k: round(statistics.median(v), 4) for k, v in durs.items()}
        out["span_max_s"] = {k: round(max(v), 4) for k, v in durs.items()}
        _say(
            config,
            f"phase {cmd['phase']} spans: p50 {out['span_p50_s']} max {out['span_max_s']} "
            f"n {out['span_counts']}",
        )
    return out


def _write(path: str, obj: dict[str, Any]) -> None:
    """Write ``obj`` as JSON to ``path`` atomically (the parent polls for the file)."""
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


def main(spec_path: str, out_dir: str) -> int:
    """Build the engine, write ``OUT_DIR/ready.json``, then serve the commands read from
    stdin, one JSON object a line, until ``quit`` or end of input: ``{"op": "phase", "id":
    N, "phase", "seed", "prefix_seed", "qps"}`` or ``{"op": "floor", "id": N}``; each
    answer goes to ``OUT_DIR/N.json`` (``error`` set when it failed). An engine that fails
    to build writes its error to ``ready.json`` and exits 1."""
    with open(spec_path) as f:
        spec = json.load(f)
    config = spec["config"]
    try:
        import setproctitle

        setproctitle.setproctitle(f"kvfabric-bench-serve EngineCore {config}")
    except ImportError:
        pass
    llm = None
    ready: dict[str, Any] = {}
    try:
        preset = Preset(**spec["preset"])
        exporter = None
        if spec.get("trace"):
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import SimpleSpanProcessor
            from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

            from kvfabric.ucm_layer.connector.tracing import use_tracer_provider

            exporter = InMemorySpanExporter()
            provider = TracerProvider()
            provider.add_span_processor(SimpleSpanProcessor(exporter))
            use_tracer_provider(provider)
        t0 = time.perf_counter()
        llm = build_engine(spec["model"], spec["transfer"], spec["kv_bytes"], preset.max_model_len)
        ready["engine_start_s"] = round(time.perf_counter() - t0, 2)
        cc = llm.llm_engine.vllm_config.cache_config
        ready["kv_cache_blocks"] = getattr(cc, "num_gpu_blocks", None)
        _say(config, f"engine up in {ready['engine_start_s']} s ({ready['kv_cache_blocks']} KV blocks)")
        _one(llm, list(make_prefixes(Preset("w", 1, 64, 1, 0, 1, 0), 999)[0]))  # one-time costs
    except BaseException as e:  # noqa: BLE001 - the row says what went wrong
        ready["error"] = f"{type(e).__name__}: {e}"
        ready["traceback"] = traceback.format_exc()[-3000:]
        _write(os.path.join(out_dir, "ready.json"), ready)
        if llm is not None:
            _close(llm)
        return 1
    _write(os.path.join(out_dir, "ready.json"), ready)
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "quit":
                break
            res: dict[str, Any] = {}
            try:
                if cmd["op"] == "phase":
                    res = _run_phase(llm, preset, config, cmd, exporter)
                elif cmd["op"] == "floor":
                    _say(config, "warm single-request floor")
                    res = warm_floor(llm, preset, cmd["seed"], exporter, spec["model"])
                    _say(config, f"floor: {res}")
                else:
                    raise ValueError(f"unknown command op {cmd['op']!r}")
            except Exception as e:  # noqa: BLE001 - the row says what went wrong
                res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            _write(os.path.join(out_dir, f"{cmd['id']}.json"), res)
    finally:
        _close(llm)
    return 0


def _close(llm: Any) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort on teardown
        pass
    try:
        from kvfabric.ucm_layer.connector.connector import instances

        for c in instances():
            c.shutdown()
    except Exception:  # noqa: BLE001
        pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
