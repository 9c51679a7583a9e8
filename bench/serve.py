"""``kvfabric bench serve [--quick] [--json] [--plot DIR]``: a prefix-reuse serving workload
on the CPU build of vLLM with SmolLM2-135M-Instruct, configurations side by side.

Workload (``bench/serve_workload.py``): shared prefixes, each reused by several requests
with their own questions, in a seeded random order; two phases per configuration, each on
prefixes of its own: ``saturation`` (every request at once) and ``rate`` (Poisson arrivals
at ``rate_fraction`` of vLLM-alone's measured saturation requests/s, the same QPS for every
configuration). vLLM's KV cache is ``kv_cache_tokens`` (its own prefix cache lives in it),
well below a phase's working set, so what an external tier holds is what it adds.

Configurations, in this order, each an engine in its own process (``bench/serve_worker.py``;
a crash or a timeout becomes a row with the error):

* ``vllm`` (baseline): vLLM alone, its own prefix cache on;
* peers: ``ExampleConnector`` (safetensors files), ``OffloadingConnector`` and
  ``SimpleCPUOffloadConnector`` (vLLM's CPU offloading), ``LMCacheConnectorV1``,
  ``MooncakeStoreConnector``; one that cannot start here is a row with ``status: error``
  and the reason;
* ``kvfabric cache|pool``: a process-local cache tier above a pool daemon this benchmark
  starts (``kvfabric pool serve``); this engine also measures the warm single-request floor
  (row ``phase: warm_single``: ``ttft_floor_s``, ``ratio_warm_ttft_vs_floor`` and a
  breakdown from the connector's spans);
* ``kvfabric posix``: the ``posix`` store (files under the run's temporary directory);
* ``kvfabric cache|pool, second engine``: a new engine process on the same daemon
  re-serving the saturation phase's prefixes (new questions) that the first engine stored:
  the reuse no single-engine cache serves. Engines run one after another (one engine at a
  time on this machine); the daemon outlives the first.

Before each engine starts, the run waits while another vLLM engine runs on the machine (a
process named ``EngineCore``, or one with vLLM's compiled ops mapped). SIGTERM, like
Ctrl-C, stops the child and the daemon before the run exits. At the end the daemon and every child
are stopped; rows carry ``shm_segments_left``, the ``/dev/shm`` entries of this run's pool
(named after ``POOL_NAME``) still there (0 expected).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvfabric.bench.report import BenchContext, cpu_busy_fraction, machine_note, read_cpu_row
from kvfabric.bench.serve_workload import (
    FULL,
    QUICK,
    ConfigKind,
    Phase,
    Preset,
    add_ratios,
    floor_figures,
    make_row,
)

POOL_NAME = "kvf-bench-serve"
SEEDS = {Phase.SATURATION: 101, Phase.RATE: 202}
SECOND_ENGINE_SEED = 303
FLOOR_SEED = 404


@dataclass(frozen=True)
class Config:
    """One configuration: a name, its kind, its ``kv_transfer_config`` (None: vLLM alone),
    whether it measures the floor, and whether it re-serves the saturation prefixes as a
    second engine."""

    name: str
    kind: ConfigKind
    transfer: dict[str, Any] | None
    floor: bool = False
    second_engine: bool = False
    needs_module: str | None = None  # a package the connector imports: checked before an engine starts


def _say(msg: str) -> None:
    print(f"[serve] {msg}", file=sys.stderr, flush=True)


def configs(tmp: str, pool_socket: str, preset: Preset, bytes_per_token: int) -> list[Config]:
    """The configurations in run order (see the module docstring)."""
    from kvfabric.harness.engine import example_transfer_config, kvfabric_transfer_config

    tier = 3 * preset.working_set_tokens * bytes_per_token  # both phases and the floor fit
    pool = kvfabric_transfer_config("cache|pool", cache_bytes=str(tier), pool_address=pool_socket)
    both = {"kv_role": "kv_both"}
    return [
        Config("vllm", ConfigKind.BASELINE, None),
        Config("ExampleConnector", ConfigKind.PEER, example_transfer_config(f"{tmp}/example")),
        Config(
            "OffloadingConnector",
            ConfigKind.PEER,
            {
                "kv_connector": "OffloadingConnector",
                **both,
                "kv_connector_extra_config": {"cpu_bytes_to_use": tier},
            },
        ),
        Config(
            "SimpleCPUOffloadConnector",
            ConfigKind.PEER,
            {
                "kv_connector": "SimpleCPUOffloadConnector",
                **both,
                "kv_connector_extra_config": {"cpu_bytes_to_use": tier},
            },
        ),
        Config(
            "LMCacheConnectorV1",
            ConfigKind.PEER,
            {"kv_connector": "LMCacheConnectorV1", **both},
            needs_module="lmcache",
        ),
        Config("MooncakeStoreConnector", ConfigKind.PEER, {"kv_connector": "MooncakeStoreConnector", **both}),
        Config("kvfabric cache|pool", ConfigKind.KVFABRIC, pool, floor=True),
        Config("kvfabric posix", ConfigKind.KVFABRIC, kvfabric_transfer_config("posix", f"{tmp}/posix")),
        Config("kvfabric cache|pool, second engine", ConfigKind.KVFABRIC, pool, second_engine=True),
    ]


def _other_engines() -> list[str]:
    """Command lines of other processes that run a vLLM engine: named ``EngineCore``
    (vLLM's engine-core process), or with vLLM's compiled ops mapped (an engine in
    process, e.g. another benchmark)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            if "EngineCore" in cmd and "pgrep" not in cmd:
                found.append(f"{pid} {cmd}")
                continue
            with open(f"/proc/{pid}/maps", "rb") as f:
                if b"/vllm/_C" in f.read():
                    found.append(f"{pid} {cmd}")
        except OSError:
            continue
    return found


def _wait_for_machine(max_wait_s: float = 900.0) -> float:
    """Wait while another engine runs on this machine (at most ``max_wait_s``); seconds waited."""
    t0 = time.perf_counter()
    while (others := _other_engines()) and time.perf_counter() - t0 < max_wait_s:
        _say(f"waiting: another engine runs ({others[0][:80]})")
        time.sleep(10)
    return time.perf_counter() - t0


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _shm() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def _start_pool(tmp: str, dram: int, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], str]:
    from kvfabric.pool.autostart import probe

    sock = f"{tmp}/pool.sock"
    log = open(f"{tmp}/pool.log", "ab")  # noqa: SIM115 - the daemon's stdout for its life
    cmd = [sys.executable, "-m", "kvfabric.cli", "pool", "serve", "--name", POOL_NAME]
    cmd += ["--dram", str(dram), "--socket", sock]
    proc = subprocess.Popen(
        cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, start_new_session=True
    )
    deadline = time.perf_counter() + 120
    while time.perf_counter() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"pool daemon exited ({proc.returncode}): {Path(f'{tmp}/pool.log').read_text()[-2000:]}"
            )
        if os.path.exists(sock) and probe(sock) is not None:
            return proc, sock
        time.sleep(0.2)
    raise RuntimeError("pool daemon did not answer within 120 s")


def _stop_group(proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    """SIGTERM the process group ``proc`` leads, SIGKILL it after ``timeout``, reap ``proc``."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue
    if proc.poll() is None:
        proc.wait()


def run_config(
    cfg: Config, spec: dict[str, Any], tmp: str, env: dict[str, str], timeout_s: float
) -> dict[str, Any]:
    """Run one configuration's worker process; its result (``error`` set when it failed)."""
    stem = f"{tmp}/{abs(hash(cfg.name)) % 10**8}"
    with open(f"{stem}.spec.json", "w") as f:
        json.dump(spec, f)
    waited = _wait_for_machine()
    _say(f"{cfg.name}: starting" + (f" (waited {waited:.0f} s)" if waited > 1 else ""))
    t0 = time.perf_counter()
    with open(f"{stem}.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvfabric.bench.serve_worker", f"{stem}.spec.json", f"{stem}.out.json"],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        timed_out = False
        try:
            pos = 0
            while proc.poll() is None:
                if time.perf_counter() - t0 > timeout_s:
                    timed_out = True
                    break
                time.sleep(1)
                pos = _relay(f"{stem}.log", pos)
            _relay(f"{stem}.log", pos)
        finally:
            _stop_group(proc)
    try:
        with open(f"{stem}.out.json") as f:
            result = json.load(f)
    except (OSError, ValueError):
        tail = Path(f"{stem}.log").read_text(errors="replace")[-1500:]
        result = {"error": f"the engine process exited {proc.returncode} without a result: {tail}"}
    if timed_out:
        result["error"] = f"timed out after {timeout_s:.0f} s"
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    _say(
        f"{cfg.name}: done in {result['wall_s']} s"
        + (f", error: {result['error'][:200]}" if "error" in result else "")
    )
    return result


def _relay(path: str, pos: int) -> int:
    """Print the worker's progress lines written since ``pos``; the new position."""
    try:
        with open(path, "rb") as f:
            f.seek(pos)
            data = f.read()
    except OSError:
        return pos
    for ln in data.decode(errors="replace").splitlines():
        if ln.startswith("[serve "):
            print(ln[:400], file=sys.stderr, flush=True)
    return pos + len(data)


def _error_text(err: str) -> str:
    """The last line of an exception text that says what failed (vLLM wraps the cause)."""
    return " ".join(err.split())[:600]


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
            make_row(cfg.name, cfg.kind, phase, status="error", error=_error_text(result["error"]), **base)
        )
    return rows


def plot(rows: list[dict[str, Any]], out_dir: str) -> str:
    """A PNG of TTFT p50/p90/p99 and requests/s per configuration and phase; its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    phases = [p.value for p in (Phase.SATURATION, Phase.RATE)]
    fig, axes = plt.subplots(2, len(phases), figsize=(7 * len(phases), 8), squeeze=False)
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
    fig.tight_layout()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "serve.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


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
    shm0 = _shm()
    tmp = tempfile.mkdtemp(prefix="kvf-bench-serve-")
    env = {**os.environ, "XDG_RUNTIME_DIR": tmp, "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}
    timeout_s = 420.0 if ctx.quick else 3600.0
    _say(
        f"preset {preset.name}: {preset.prefixes} prefixes x {preset.prefix_tokens} tokens, "
        f"{preset.requests_per_prefix} requests each, vLLM KV cache {preset.kv_cache_tokens} tokens "
        f"({preset.kv_cache_tokens * bpt / 2**20:.0f} MiB), working set {preset.working_set_tokens} tokens"
    )
    daemon = None
    rows: list[dict[str, Any]] = []
    prev_term = signal.signal(signal.SIGTERM, _terminate)  # cleanup below runs on SIGTERM too
    try:
        daemon, sock = _start_pool(tmp, 4 * preset.working_set_tokens * bpt, env)
        qps: float | None = None
        for cfg in configs(tmp, sock, preset, bpt):
            if cfg.second_engine:
                phases = [
                    {
                        "phase": Phase.SECOND_ENGINE.value,
                        "seed": SECOND_ENGINE_SEED,
                        "prefix_seed": SEEDS[Phase.SATURATION],
                        "qps": None,
                    }
                ]
            else:
                phases = [
                    {
                        "phase": Phase.SATURATION.value,
                        "seed": SEEDS[Phase.SATURATION],
                        "prefix_seed": SEEDS[Phase.SATURATION],
                        "qps": None,
                    },
                    {
                        "phase": Phase.RATE.value,
                        "seed": SEEDS[Phase.RATE],
                        "prefix_seed": SEEDS[Phase.RATE],
                        "qps": qps or "auto",
                    },
                ]
            spec = {
                "config": cfg.name,
                "transfer": cfg.transfer,
                "preset": asdict(preset),
                "phases": phases,
                "model": model,
                "kv_bytes": preset.kv_cache_tokens * bpt,
                "floor": cfg.floor,
                "floor_seed": FLOOR_SEED,
                "trace": cfg.floor,
            }
            if cfg.needs_module and importlib.util.find_spec(cfg.needs_module) is None:
                msg = f"the {cfg.needs_module!r} package is not installed in this environment"
                _say(f"{cfg.name}: not run, {msg}")
                result: dict[str, Any] = {"error": msg}
            else:
                result = run_config(cfg, spec, tmp, env, timeout_s)
            if cfg.kind is ConfigKind.BASELINE:
                qps = next(
                    (p["qps"] for p in result.get("phases", []) if p["phase"] == Phase.RATE.value), None
                )
            rows += rows_of(cfg, result, preset)
    finally:
        if daemon is not None:
            _stop_group(daemon)
        shutil.rmtree(tmp, ignore_errors=True)
        signal.signal(signal.SIGTERM, prev_term)
    left = sorted(n for n in _shm() - shm0 if POOL_NAME in n)
    busy = cpu_busy_fraction((cpu0, read_cpu_row()))
    rows = add_ratios(rows)
    if ctx.options.get("plot_dir"):
        path = plot(rows, str(ctx.options["plot_dir"]))
        _say(f"plot: {path}")
    for r in rows:
        r.update(note)
        r["cpu_busy"] = round(busy, 2)
        r["preset"] = preset.name
        r["vllm_kv_cache_tokens"] = preset.kv_cache_tokens
        r["working_set_tokens"] = preset.working_set_tokens
        r["shm_segments_left"] = len(left)
        yield {k: v for k, v in r.items()}
