"""The processes of ``kvfabric bench serve``: one engine process per configuration
(:class:`Worker`, running ``bench/serve_worker.py``), the pool daemon and the local
Mooncake servers it starts, the wait for other engines on the machine, and the stop of
each process group. Every process here leads its own session, so a stop reaches its
children too."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvfabric.bench.serve_configs import Config

#: the pool daemon's name (its ``/dev/shm`` segments are named after it)
POOL_NAME = "kvf-bench-serve"


def say(msg: str) -> None:
    print(f"[serve] {msg}", file=sys.stderr, flush=True)


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


def wait_for_machine(max_wait_s: float = 900.0) -> float:
    """Wait while another engine runs on this machine (at most ``max_wait_s``); seconds waited."""
    t0 = time.perf_counter()
    while (others := _other_engines()) and time.perf_counter() - t0 < max_wait_s:
        say(f"waiting: another engine runs ({others[0][:80]})")
        time.sleep(10)
    return time.perf_counter() - t0


def shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def start_pool(tmp: str, dram: int, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], str]:
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


def stop_group(proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
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
        say(
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
        stop_group(self.proc)
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


def error_text(err: str) -> str:
    """The last line of an exception text that says what failed (vLLM wraps the cause)."""
    return " ".join(err.split())[:600]


def _free_port() -> int:
    import socket

    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        return int(so.getsockname()[1])


def start_mooncake(
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
                        stop_group(p)
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


__all__ = [
    "POOL_NAME",
    "Worker",
    "error_text",
    "say",
    "shm_entries",
    "start_mooncake",
    "start_pool",
    "stop_group",
    "wait_for_machine",
]
