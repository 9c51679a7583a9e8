"""``kvfabric bench serve [--quick] [--json] [--plot DIR]``: a prefix-reuse serving workload
on the CPU build of vLLM with SmolLM2-135M-Instruct, configurations side by side.

Workload (``bench/serve_workload.py``): shared prefixes, each reused by several requests
with their own questions, in a seeded random order; two phases: ``saturation`` (every
request at once) and ``rate`` (Poisson arrivals at ``rate_fraction`` of vLLM-alone's
measured saturation requests/s, the median of its runs, the same QPS for every
configuration). Every run of a phase serves prefixes of its own (seeded by its slot), so
no store holds them beforehand, in the same order at the same arrival times (one order seed
per phase), so every configuration sees the same reuse pattern. vLLM's KV cache is
``kv_cache_tokens`` (its own prefix cache lives in it), below a phase's working set, so
what an external tier holds is what it adds.

Configurations (``bench/serve_configs.py``), each an engine in its own process
(``bench/serve_worker.py``, driven through ``bench/serve_procs.py``) that lives for the
whole run; all are started at once, then they take turns, one engine serving at a
time (a crash or a timeout becomes a row with the error):

* ``vllm`` (baseline): vLLM alone, its own prefix cache on;
* peers: ``ExampleConnector`` (safetensors files), ``OffloadingConnector`` and
  ``SimpleCPUOffloadConnector`` (vLLM's CPU offloading), ``LMCacheConnectorV1``,
  ``MooncakeStoreConnector`` (against a Mooncake metadata server and master this
  benchmark starts on 127.0.0.1, when the ``mooncake`` package is installed); one that
  cannot start here is a row with ``status: error`` and the reason (under ``--quick`` the
  two whose refusal is a platform condition, ``Config.refusal``, are checked in this
  process instead of starting an engine);
* ``kvfabric cache|pool``: a process-local cache tier above a pool daemon this benchmark
  starts (``kvfabric pool serve``); this engine also measures the warm single-request floor
  at the end (row ``phase: warm_single``: ``ttft_floor_s``, ``ratio_warm_ttft_vs_floor``
  and a breakdown from the connector's spans);
* ``kvfabric posix``: the ``posix`` store (files under the run's temporary directory);
* ``kvfabric cache|pool, second engine``: another engine process on the same daemon
  re-serving the prefixes that the first engine stored in its saturation run (new
  questions): the reuse no single-engine cache serves.

Drift in the machine's load: each phase runs vLLM alone before and after every other
configuration (``flanked_schedule``: ``vllm, A, vllm, B, ..., vllm``; the second engine
last, flanked the same way), and every ratio to vLLM alone is taken against the baseline
runs right next to it (``vllm_adjacent_*``, ``flank_figures``); the ``vllm`` row pools its
runs and lists each run's figures.

``KVFABRIC_BENCH_SERVE_CONFIGS`` (names separated by ``;``) runs a subset next to vLLM
alone; it may also name the variants of :func:`variants` (kvfabric with one setting
changed: a synchronous load, the Delegator's gather, the pipeline's write-behind, the pool
or the cache tier alone).

Before the engines start, the run waits while another vLLM engine runs on the machine (a
process named ``EngineCore``, or one with vLLM's compiled ops mapped). SIGTERM, like
Ctrl-C, stops the children and the daemons before the run exits. At the end the daemons and
every child are stopped; rows carry ``shm_segments_left``, the ``/dev/shm`` entries of this
run's pool (named after ``POOL_NAME``) still there (0 expected).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

from kvfabric.bench.flank import flanked_schedule
from kvfabric.bench.report import BenchContext, cpu_busy_fraction, machine_note, read_cpu_row
from kvfabric.bench.serve_configs import Config, configs, variants
from kvfabric.bench.serve_procs import (
    POOL_NAME,
    Worker,
    error_text,
    say,
    shm_entries,
    start_mooncake,
    start_pool,
    stop_group,
    wait_for_machine,
)
from kvfabric.bench.serve_workload import (
    FULL,
    QUICK,
    ConfigKind,
    Phase,
    Preset,
    RequestRecord,
    add_ratios,
    flank_figures,
    floor_figures,
    make_row,
    phase_stats,
)

SEEDS = {Phase.SATURATION: 101, Phase.RATE: 202}
SECOND_ENGINE_SEED = 303
FLOOR_SEED = 404


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


#: what a phase entry may carry beyond its stats into its row
_PHASE_EXTRAS = (
    "vllm_adjacent_ttft_p50_s",
    "vllm_adjacent_requests_per_s",
    "runs",
    "requests_per_s_runs",
    "ttft_p50_s_runs",
    "spans_s",
    "span_counts",
    "span_p50_s",
    "span_max_s",
)


def rows_of(cfg: Config, result: dict[str, Any], preset: Preset) -> list[dict[str, Any]]:
    """A configuration's rows: one per phase served, the floor row, or one error row."""
    base = {"kv_cache_blocks": result.get("kv_cache_blocks"), "engine_start_s": result.get("engine_start_s")}
    rows = []
    for ph in result.get("phases", []):
        st = ph["stats"]
        rows.append(
            make_row(
                cfg.name,
                cfg.kind,
                Phase(ph["phase"]),
                **st,
                qps=round(ph["qps"], 3) if ph["qps"] else None,
                **{k: ph[k] for k in _PHASE_EXTRAS if k in ph},
                **base,
            )
        )
    fl = result.get("floor")
    if fl:
        figs = floor_figures(fl["hit_bytes"], fl["memcpy_gbps"], fl["resident_ttft_s"], fl["warm_ttft_s"])
        spans = fl["spans_s"]
        lookup, load = spans.get("lookup", 0.0), spans.get("load", 0.0)
        rest = fl["warm_ttft_s"] - fl["resident_ttft_s"] - lookup - load
        rows.append(
            make_row(
                cfg.name,
                cfg.kind,
                Phase.WARM_SINGLE,
                ttft_p50_s=round(fl["warm_ttft_s"], 4),
                hit_rate=round(fl["hit_tokens"] / (preset.prefix_tokens + preset.question_tokens), 4),
                **figs,
                hit_tokens=fl["hit_tokens"],
                breakdown_lookup_s=round(lookup, 5),
                breakdown_load_s=round(load, 5),
                breakdown_engine_s=round(fl["resident_ttft_s"], 4),
                breakdown_other_s=round(rest, 4),
                spans_s={k: round(v, 5) for k, v in spans.items()},
                rounds=fl["rounds"],
                **base,
            )
        )
    if "error" in result:
        phase = Phase.SECOND_ENGINE if cfg.second_engine else None
        rows.append(
            make_row(cfg.name, cfg.kind, phase, status="error", error=error_text(result["error"]), **base)
        )
    return rows


def plot(rows: list[dict[str, Any]], out_dir: str) -> str:
    """A PNG per configuration and phase: TTFT p50/p90/p99, requests/s, and both ratios to
    the adjacent vLLM-alone runs (the figures the load's drift does not move); its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    phases = [p.value for p in (Phase.SATURATION, Phase.RATE)]
    fig, axes = plt.subplots(3, len(phases), figsize=(7 * len(phases), 12), squeeze=False)
    for j, phase in enumerate(phases):
        ok = [r for r in rows if r["status"] == "ok" and r["phase"] == phase]
        if phase == Phase.SATURATION.value:
            ok += [r for r in rows if r["status"] == "ok" and r["phase"] == Phase.SECOND_ENGINE.value]
        names = [
            r["config"].replace("kvfabric ", "kvf ").replace(", second engine", "\n2nd engine") for r in ok
        ]
        x = np.arange(len(ok))
        ax = axes[0][j]
        for k, (key, lab) in enumerate((("ttft_p50_s", "p50"), ("ttft_p90_s", "p90"), ("ttft_p99_s", "p99"))):
            ax.bar(x + (k - 1) * 0.27, [r[key] for r in ok], 0.27, label=lab)
        ax.set_title(f"TTFT, phase {phase}")
        ax.set_ylabel("seconds")
        ax.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
        ax.legend()
        ax = axes[1][j]
        ax.bar(x, [r["requests_per_s"] for r in ok], 0.6)
        ax.set_title(f"requests/s, phase {phase}")
        ax.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
        ax = axes[2][j]
        for k, (key, lab) in enumerate(
            (
                ("ratio_ttft_p50_vs_vllm", "TTFT p50: vLLM / this"),
                ("ratio_requests_per_s_vs_vllm", "req/s: this / vLLM"),
            )
        ):
            ax.bar(x + (k - 0.5) * 0.4, [r.get(key) or 0.0 for r in ok], 0.4, label=lab)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_title(f"ratios to the adjacent vLLM-alone runs (> 1: better), phase {phase}")
        ax.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
        ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "serve.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One phase entry from several runs of it (the baseline's): stats over every request
    and the summed wall time, with each run's requests/s and TTFT p50 kept."""
    recs = [RequestRecord(**r) for run in runs for r in run["records"]]
    st = phase_stats(recs, sum(run["stats"]["wall_s"] for run in runs))
    return {
        "phase": runs[0]["phase"],
        "qps": runs[0]["qps"],
        "stats": st,
        "runs": len(runs),
        "requests_per_s_runs": [run["stats"]["requests_per_s"] for run in runs],
        "ttft_p50_s_runs": [run["stats"]["ttft_p50_s"] for run in runs],
    }


def run(ctx: BenchContext) -> Iterator[dict[str, Any]]:
    from kvfabric.bench.serve_worker import kv_bytes_per_token
    from kvfabric.harness.engine import vllm_problem
    from kvfabric.harness.models import smollm2

    problem = vllm_problem()
    if problem:
        raise ImportError(f"kvfabric bench serve needs vLLM: {problem}")
    preset = QUICK if ctx.quick else FULL
    model = str(smollm2())
    bpt = kv_bytes_per_token(model)
    note = machine_note()
    cpu0 = read_cpu_row()
    shm0 = shm_entries()
    tmp = tempfile.mkdtemp(prefix="kvf-bench-serve-")
    t_run = time.perf_counter()
    env = {**os.environ, "XDG_RUNTIME_DIR": tmp, "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}
    ready_s, call_s = (480.0, 300.0) if ctx.quick else (900.0, 1500.0)
    say(
        f"preset {preset.name}: {preset.prefixes} prefixes x {preset.prefix_tokens} tokens, "
        f"{preset.requests_per_prefix} requests each, vLLM KV cache {preset.kv_cache_tokens} tokens "
        f"({preset.kv_cache_tokens * bpt / 2**20:.0f} MiB), working set {preset.working_set_tokens} tokens"
    )
    daemons: list[subprocess.Popen[bytes]] = []
    workers: list[Worker] = []
    results: dict[str, dict[str, Any]] = {}
    prev_term = signal.signal(signal.SIGTERM, _terminate)  # cleanup below runs on SIGTERM too
    try:
        daemon, sock = start_pool(tmp, 4 * preset.working_set_tokens * bpt, env)
        daemons.append(daemon)
        cfgs = configs(tmp, sock, preset, bpt)
        only = [n.strip() for n in os.environ.get("KVFABRIC_BENCH_SERVE_CONFIGS", "").split(";") if n.strip()]
        if only:  # a subset, e.g. to look into one configuration; vLLM alone always runs
            unknown = sorted(set(only) - {c.name for c in cfgs + variants(tmp, sock, preset, bpt)})
            if unknown:
                raise ValueError(
                    f"KVFABRIC_BENCH_SERVE_CONFIGS names no configuration {unknown}; "
                    f"known: {[c.name for c in cfgs + variants(tmp, sock, preset, bpt)]}"
                )
            cfgs += variants(tmp, sock, preset, bpt)
            cfgs = [c for c in cfgs if c.kind is ConfigKind.BASELINE or c.name in only]
        waited = wait_for_machine()
        if waited > 1:
            say(f"waited {waited:.0f} s for another engine to end")
        for cfg in cfgs:
            results[cfg.name] = {"phases": []}
            wenv = env
            if cfg.needs_module and importlib.util.find_spec(cfg.needs_module) is None:
                msg = f"the {cfg.needs_module!r} package is not installed in this environment"
                say(f"{cfg.name}: not run, {msg}")
                results[cfg.name]["error"] = msg
                continue
            refused = cfg.refusal() if cfg.refusal is not None and ctx.quick else None
            if refused:
                say(f"{cfg.name}: not run, {refused}")
                results[cfg.name]["error"] = refused
                continue
            if cfg.name == "MooncakeStoreConnector":
                try:
                    procs, extra = start_mooncake(tmp, 3 * preset.working_set_tokens * bpt, env)
                    daemons += procs
                    wenv = {**env, **extra}
                except RuntimeError as e:
                    say(f"{cfg.name}: {e}; its engine starts without a config")
            spec = {
                "config": cfg.name,
                "transfer": cfg.transfer,
                "preset": asdict(preset),
                "model": model,
                "kv_bytes": preset.kv_cache_tokens * bpt,
                "trace": cfg.kind is ConfigKind.KVFABRIC,  # the connector's spans per phase
            }
            w = Worker(cfg, spec, tmp, wenv)
            w.start()
            workers.append(w)
        say(f"{len(workers)} engines starting at once (each in its own process)")
        for w in workers:
            w.wait_ready(ready_s)
            results[w.cfg.name].update(
                kv_cache_blocks=w.ready.get("kv_cache_blocks"), engine_start_s=w.ready.get("engine_start_s")
            )
            if w.error:
                results[w.cfg.name]["error"] = w.error
        by_name = {w.cfg.name: w for w in workers if not w.error}
        base = next(c.name for c in cfgs if c.kind is ConfigKind.BASELINE)
        if base not in by_name:
            raise RuntimeError(f"vLLM alone did not start: {results[base].get('error')}")
        single = [
            c.name
            for c in cfgs
            if c.name in by_name and c.kind is not ConfigKind.BASELINE and not c.second_engine
        ]
        second = [c.name for c in cfgs if c.name in by_name and c.second_engine]
        first_of_second = next((c.name for c in cfgs if c.floor), None)
        prefix_seed_of: dict[str, int] = {}

        def one(
            name: str, phase: Phase, slot: int, qps: float | None, prefix_seed: int | None = None
        ) -> dict[str, Any]:
            seed = SEEDS[phase] * 100 + slot if phase is not Phase.SECOND_ENGINE else SECOND_ENGINE_SEED
            ps = prefix_seed if prefix_seed is not None else seed
            if phase is Phase.SATURATION:
                prefix_seed_of[name] = ps
            order_seed = SEEDS[Phase.SATURATION if phase is Phase.SECOND_ENGINE else phase]
            cmd = {
                "op": "phase",
                "phase": phase.value,
                "seed": seed,
                "prefix_seed": ps,
                "order_seed": order_seed,  # every run of a phase: the same order and arrival times
                "qps": qps,
            }
            say(f"{name}: phase {phase.value} (run {slot + 1})")
            return by_name[name].call(cmd, call_s)

        for phase in (Phase.SATURATION, Phase.RATE):
            order = flanked_schedule(single, base)
            if phase is Phase.SATURATION and second:
                order += [*second, base]
            qps = None
            if phase is Phase.RATE:
                sat = [
                    r["stats"]["requests_per_s"]
                    for r in results[base]["phases"]
                    if r["phase"] == Phase.SATURATION.value
                ]
                qps = preset.rate_fraction * statistics.median(sat)
            runs: list[tuple[str, dict[str, Any]]] = []
            for slot, name in enumerate(order):
                cfg_phase = Phase.SECOND_ENGINE if name in second else phase
                ps = prefix_seed_of.get(first_of_second or "") if name in second else None
                res = one(name, cfg_phase, slot, qps, ps)
                if "error" in res:
                    results[name].setdefault("error", res["error"])
                    runs.append((name, {}))
                    if name == base:
                        raise RuntimeError(f"vLLM alone failed: {res['error']}")
                    continue
                runs.append((name, res["stats"]))
                results[name]["phases"].append(res)
            for (name, _), figs in zip(runs, flank_figures(runs, base), strict=True):
                if figs:
                    entry = next(
                        p
                        for p in reversed(results[name]["phases"])
                        if p["phase"] in (phase.value, Phase.SECOND_ENGINE.value)
                    )
                    entry.update(figs)
            bruns = [p for p in results[base]["phases"] if p["phase"] == phase.value]
            results[base]["phases"] = [p for p in results[base]["phases"] if p["phase"] != phase.value] + [
                _pooled(bruns)
            ]
        floor_cfg = next((c for c in cfgs if c.floor and c.name in by_name), None)
        if floor_cfg is not None:
            res = by_name[floor_cfg.name].call({"op": "floor", "seed": FLOOR_SEED}, call_s)
            if "error" in res:
                results[floor_cfg.name].setdefault("error", res["error"])
            else:
                results[floor_cfg.name]["floor"] = res
    finally:
        for w in workers:
            w.stop()
        for d in daemons:
            stop_group(d)
        shutil.rmtree(tmp, ignore_errors=True)
        signal.signal(signal.SIGTERM, prev_term)
    say(f"run took {time.perf_counter() - t_run:.0f} s")
    rows: list[dict[str, Any]] = []
    for cfg in cfgs:
        rows += rows_of(cfg, results[cfg.name], preset)
    left = sorted(n for n in shm_entries() - shm0 if POOL_NAME in n)
    busy = cpu_busy_fraction((cpu0, read_cpu_row()))
    rows = add_ratios(rows)
    if ctx.options.get("plot_dir"):
        path = plot(rows, str(ctx.options["plot_dir"]))
        say(f"plot: {path}")
    for r in rows:
        r.update(note)
        r["cpu_busy"] = round(busy, 2)
        r["preset"] = preset.name
        r["vllm_kv_cache_tokens"] = preset.kv_cache_tokens
        r["working_set_tokens"] = preset.working_set_tokens
        r["shm_segments_left"] = len(left)
        yield {k: v for k, v in r.items()}
