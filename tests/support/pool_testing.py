"""Helpers for pool tests: a daemon subprocess and deterministic object contents."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np


def content(key: str, size: int) -> bytes:
    """The bytes every test writer stores under ``key`` (so any reader can verify them)."""
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def _die_with_parent() -> None:
    """In the child before exec: get SIGKILL when the test process dies (Linux)."""
    import ctypes

    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Daemon:
    """``kvfabric pool serve`` in a subprocess; ``start()`` waits for its ready line.

    Every daemon started is remembered in ``Daemon.started`` so a fixture can kill what a
    failing test left behind (``kill_leftovers``); a daemon also dies with the test process.
    """

    started: list[Daemon] = []

    def __init__(
        self,
        tmp: Path,
        name: str = "t",
        dram: str = "64MiB",
        extra: dict | None = None,
        env: dict | None = None,
        tag: str = "",
    ) -> None:
        """``env``: variables set for the daemon over this process's (e.g. its own
        ``KVFABRIC_SHM_DIR``, a node of its own); ``tag``: names its files when several
        daemons of one pool share ``tmp``."""
        self.tmp = Path(tmp)
        self.env = env or {}
        self.socket = str(self.tmp / f"{name}{tag}.sock")
        self.name = name
        self.cfg = self.tmp / f"{name}{tag}.yaml"
        settings = {
            "name": name,
            "dram": dram,
            "socket": self.socket,
            "max_objects": 8192,
            "http": "127.0.0.1:0",
            **(extra or {}),
        }
        self.cfg.write_text("".join(f"{k}: {v}\n" for k, v in settings.items()))
        self.proc: subprocess.Popen | None = None
        self.ready: dict = {}

    def start(self, timeout: float = 60.0) -> Daemon:
        return self.launch().wait_ready(timeout)

    def launch(self) -> Daemon:
        """Start the process without waiting (``wait_ready`` then): several start at once."""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvfabric.cli", "pool", "serve", "--config", str(self.cfg)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **self.env},
            preexec_fn=_die_with_parent,
        )
        Daemon.started.append(self)
        return self

    def wait_ready(self, timeout: float = 60.0) -> Daemon:
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"pool daemon exited: {self.proc.stderr.read()}")
            if line.startswith("{"):
                self.ready = json.loads(line)
                return self
        raise TimeoutError("pool daemon did not become ready")

    def metric(self, name: str) -> float:
        """The unlabelled sample ``name`` of the daemon's ``/metrics`` (KeyError if absent)."""
        url = f"http://127.0.0.1:{self.ready['http_port']}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        raise KeyError(name)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(30)

    def stop(self) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)


def campaigning_daemons(
    tmp: Path, shm: Path, etcd: str, pool: str, n: int, token: str, leader_ttl_s: int, write_lease_s: float
) -> list[Daemon]:
    """``n`` daemons of pool ``pool`` under leader election through ``etcd``, each a node of
    its own (a shared-memory directory under ``shm``), on TCP with ``token``; started
    together, returned once all are ready."""
    out = []
    for i in range(n):
        node_shm = shm / f"node{i}"
        node_shm.mkdir()
        extra = {
            "tcp": "127.0.0.1:0",
            "token": token,
            "rendezvous": etcd,
            "leader_election": "true",
            "leader_ttl_s": leader_ttl_s,
            "write_lease_s": write_lease_s,
            "session_ttl_s": 3.0,
            "pretouch": "false",
            "rpc_spin_us": 0,
        }
        env = {"KVFABRIC_SHM_DIR": str(node_shm)}
        out.append(Daemon(tmp, name=pool, dram="0", extra=extra, env=env, tag=f"-{i}").launch())
    for d in out:
        d.wait_ready(60)
    return out


def kill_leftovers() -> None:
    """Kill every daemon a test started and did not stop."""
    while Daemon.started:
        d = Daemon.started.pop()
        if d.proc is not None and d.proc.poll() is None:
            d.kill()
