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

Configurations, each an engine in its own process (``bench/serve_worker.py``) that lives
for the whole run; all are started at once, then they take turns, one engine serving at a
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
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
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
    RequestRecord,
    add_ratios,
    flank_figures,
    flanked_schedule,
    floor_figures,
    make_row,
    phase_stats,
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
    refusal: Callable[[], str | None] | None = None  # the platform condition it refuses at start (--quick)


def _offloading_refusal() -> str | None:
    """vLLM's CPU offloading spec builds its worker only on CUDA-alike and XPU platforms."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike() or current_platform.is_xpu():
        return None
    return (
        "Exception: CPU Offloading is currently only supported on CUDA-alike and XPU GPUs "
        f"(platform {type(current_platform).__name__}; checked before starting an engine)"
    )


def _simple_offload_refusal() -> str | None:
    """vLLM's simple CPU offload worker asks ``torch.cuda.Stream.priority_range()``."""
    import torch

    if callable(getattr(torch.cuda.Stream, "priority_range", None)):
        return None
    return (
        "AttributeError: torch.cuda.Stream has no attribute 'priority_range' "
        "(this torch build has no CUDA streams; checked before starting an engine)"
    )


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
            refusal=_offloading_refusal,
        ),
        Config(
            "SimpleCPUOffloadConnector",
            ConfigKind.PEER,
            {
                "kv_connector": "SimpleCPUOffloadConnector",
                **both,
                "kv_connector_extra_config": {"cpu_bytes_to_use": tier},
            },
            refusal=_simple_offload_refusal,
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


def variants(tmp: str, pool_socket: str, preset: Preset, bytes_per_token: int) -> list[Config]:
    """kvfabric with one setting changed, run only when ``KVFABRIC_BENCH_SERVE_CONFIGS``
    names them (to see what one part of the connector's path costs)."""
    from kvfabric.harness.engine import kvfabric_transfer_config

    tier = str(3 * preset.working_set_tokens * bytes_per_token)
    kvf = ConfigKind.KVFABRIC
    return [
        Config(
            "kvfabric cache|pool, sync load",
            kvf,
            kvfabric_transfer_config(
                "cache|pool", cache_bytes=tier, pool_address=pool_socket, async_load=False
            ),
        ),
        Config(
            "kvfabric cache|pool, delegator",  # dumps release vLLM's blocks once gathered
            kvf,
            kvfabric_transfer_config(
                "cache|pool", cache_bytes=tier, pool_address=pool_socket, delegator=True
            ),
        ),
        Config(
            "kvfabric cache|pool, write behind",  # dumps end once in the cache tier
            kvf,
            kvfabric_transfer_config(
                "cache|pool",
                cache_bytes=tier,
                pool_address=pool_socket,
                store_options={"pipeline.write": "behind"},
            ),
        ),
        Config(
            "kvfabric pool",
            kvf,
            kvfabric_transfer_config("pool", pool_address=pool_socket),
        ),
        Config("kvfabric cache", kvf, kvfabric_transfer_config("cache", cache_bytes=tier)),
        Config(
            "kvfabric posix, sync load",
            kvf,
            kvfabric_transfer_config("posix", f"{tmp}/posix-sync", async_load=False),
        ),
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


class Worker:
    """One configuration's engine process (``bench/serve_worker.py``), alive for the run.

    Call order: :meth:`start` (spawns it; the engine builds in the background), then
    :meth:`wait_ready` once, then any number of :meth:`call` (one at a time: the parent
    owns the order), then :meth:`stop` (always; idempotent). ``error`` is set once the
    process failed to build its engine, crashed or timed out; later calls then answer that
    error without running anything. The worker's log and answers live under ``tmp``."""

    def __init__(self, cfg: Config, spec: dict[str, Any], tmp: str, env: dict[str, str]) -> None:
        self.cfg = cfg
        self.dir = f"{tmp}/w{abs(hash(cfg.name)) % 10**8}"
        os.makedirs(self.dir, exist_ok=True)
        with open(f"{self.dir}/spec.json", "w") as f:
            json.dump(spec, f)
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready: dict[str, Any] = {}
        self.error: str | None = None
        self._pos = 0
        self._n = 0
        self.t0 = 0.0

    def start(self) -> None:
        self.t0 = time.perf_counter()
        log = open(f"{self.dir}/log", "wb")  # noqa: SIM115 - the child's output for its life
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvfabric.bench.serve_worker", f"{self.dir}/spec.json", self.dir],
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
        )
        log.close()

    def _await(self, path: str, timeout_s: float) -> dict[str, Any]:
        """The JSON the worker writes to ``path``, or an ``error`` when it exits or times out."""
        assert self.proc is not None
        t0 = time.perf_counter()
        while not os.path.exists(path):
            self._pos = _relay(f"{self.dir}/log", self._pos)
            if self.proc.poll() is not None and not os.path.exists(path):
                tail = Path(f"{self.dir}/log").read_text(errors="replace")[-1500:]
                return {"error": f"the engine process exited {self.proc.returncode} without a result: {tail}"}
            if time.perf_counter() - t0 > timeout_s:
                return {"error": f"timed out after {timeout_s:.0f} s"}
            time.sleep(0.2)
        self._pos = _relay(f"{self.dir}/log", self._pos)
        with open(path) as f:
            result: dict[str, Any] = json.load(f)
        return result

    def wait_ready(self, timeout_s: float) -> None:
        self.ready = self._await(f"{self.dir}/ready.json", timeout_s)
        self.error = self.ready.get("error")
        _say(
            f"{self.cfg.name}: "
            + (
                f"error: {self.error[:200]}"
                if self.error
                else f"engine up ({self.ready['engine_start_s']} s)"
            )
        )
        if self.error:
            self.stop()

    def call(self, cmd: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Send one command and wait for its answer (see ``serve_worker.main``)."""
        if self.error:
            return {"error": self.error}
        assert self.proc is not None and self.proc.stdin is not None
        self._n += 1
        try:
            self.proc.stdin.write((json.dumps({**cmd, "id": self._n}) + "\n").encode())
            self.proc.stdin.flush()
        except OSError as e:
            self.error = f"the engine process is gone ({e})"
            return {"error": self.error}
        res = self._await(f"{self.dir}/{self._n}.json", timeout_s)
        if ("error" in res and self.proc.poll() is not None) or res.get("error", "").startswith("timed out"):
            self.error = res["error"]
            self.stop()
        return res

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write(b'{"op": "quit"}\n')
                self.proc.stdin.close()
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                pass
        _stop_group(self.proc)
        self._pos = _relay(f"{self.dir}/log", self._pos)


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
            make_row(cfg.name, cfg.kind, phase, status="error", error=_error_text(result["error"]), **base)
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


def _free_port() -> int:
    import socket

    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        return int(so.getsockname()[1])


def _start_mooncake(
    tmp: str, segment_bytes: int, env: dict[str, str]
) -> tuple[list[subprocess.Popen[bytes]], dict[str, str]]:
    """A local Mooncake metadata server and master on 127.0.0.1 and the config file vLLM's
    ``MooncakeStoreConnector`` reads (``MOONCAKE_CONFIG_PATH``); the processes and the
    environment the connector's engine needs. Raises ``RuntimeError`` naming what is missing."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or spec.origin is None:
        raise RuntimeError("the 'mooncake' package is not installed in this environment")
    master = os.path.join(os.path.dirname(spec.origin), "mooncake_master")
    if not os.access(master, os.X_OK):
        raise RuntimeError(f"no mooncake_master binary at {master}")
    meta_port, rpc_port, metrics_port = _free_port(), _free_port(), _free_port()
    log = open(f"{tmp}/mooncake.log", "ab")  # noqa: SIM115 - the servers' output for their life
    cmds = [
        [
            sys.executable,
            "-m",
            "mooncake.http_metadata_server",
            "--host",
            "127.0.0.1",
            "--port",
            str(meta_port),
        ],
        [
            master,
            "--rpc_address=127.0.0.1",
            f"--rpc_port={rpc_port}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={metrics_port}",
            "--default_kv_lease_ttl=500",
        ],
    ]
    procs = [
        subprocess.Popen(c, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, start_new_session=True)
        for c in cmds
    ]
    log.close()
    import socket

    deadline = time.perf_counter() + 30
    for port in (meta_port, rpc_port):
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.perf_counter() > deadline or any(p.poll() is not None for p in procs):
                    for p in procs:
                        _stop_group(p)
                    tail = Path(f"{tmp}/mooncake.log").read_text(errors="replace")[-600:]
                    raise RuntimeError(f"the local Mooncake master did not start: {tail}") from None
                time.sleep(0.2)
    path = f"{tmp}/mooncake.json"
    with open(path, "w") as f:
        json.dump(
            {
                "metadata_server": f"http://127.0.0.1:{meta_port}/metadata",
                "master_server_address": f"127.0.0.1:{rpc_port}",
                "protocol": "tcp",
                "device_name": "",
                "global_segment_size": segment_bytes,
                "local_buffer_size": 256 * 2**20,
            },
            f,
        )
    return procs, {
        "MOONCAKE_CONFIG_PATH": path,
        "MC_TCP_BIND_ADDRESS": "127.0.0.1",
        "VLLM_HOST_IP": "127.0.0.1",
    }


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
    shm0 = _shm()
    tmp = tempfile.mkdtemp(prefix="kvf-bench-serve-")
    t_run = time.perf_counter()
    env = {**os.environ, "XDG_RUNTIME_DIR": tmp, "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}
    ready_s, call_s = (480.0, 300.0) if ctx.quick else (900.0, 1500.0)
    _say(
        f"preset {preset.name}: {preset.prefixes} prefixes x {preset.prefix_tokens} tokens, "
        f"{preset.requests_per_prefix} requests each, vLLM KV cache {preset.kv_cache_tokens} tokens "
        f"({preset.kv_cache_tokens * bpt / 2**20:.0f} MiB), working set {preset.working_set_tokens} tokens"
    )
    daemons: list[subprocess.Popen[bytes]] = []
    workers: list[Worker] = []
    results: dict[str, dict[str, Any]] = {}
    prev_term = signal.signal(signal.SIGTERM, _terminate)  # cleanup below runs on SIGTERM too
    try:
        daemon, sock = _start_pool(tmp, 4 * preset.working_set_tokens * bpt, env)
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
        waited = _wait_for_machine()
        if waited > 1:
            _say(f"waited {waited:.0f} s for another engine to end")
        for cfg in cfgs:
            results[cfg.name] = {"phases": []}
            wenv = env
            if cfg.needs_module and importlib.util.find_spec(cfg.needs_module) is None:
                msg = f"the {cfg.needs_module!r} package is not installed in this environment"
                _say(f"{cfg.name}: not run, {msg}")
                results[cfg.name]["error"] = msg
                continue
            refused = cfg.refusal() if cfg.refusal is not None and ctx.quick else None
            if refused:
                _say(f"{cfg.name}: not run, {refused}")
                results[cfg.name]["error"] = refused
                continue
            if cfg.name == "MooncakeStoreConnector":
                try:
                    procs, extra = _start_mooncake(tmp, 3 * preset.working_set_tokens * bpt, env)
                    daemons += procs
                    wenv = {**env, **extra}
                except RuntimeError as e:
                    _say(f"{cfg.name}: {e}; its engine starts without a config")
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
        _say(f"{len(workers)} engines starting at once (each in its own process)")
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
            _say(f"{name}: phase {phase.value} (run {slot + 1})")
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
            _stop_group(d)
        shutil.rmtree(tmp, ignore_errors=True)
        signal.signal(signal.SIGTERM, prev_term)
    _say(f"run took {time.perf_counter() - t_run:.0f} s")
    rows: list[dict[str, Any]] = []
    for cfg in cfgs:
        rows += rows_of(cfg, results[cfg.name], preset)
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
