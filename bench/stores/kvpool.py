"""The kvfabric pool as a benchmark store: ``kvfabric pool serve`` in a subprocess (it owns
the memory, as in production) and ``kvfabric.pool.connect`` clients that read and write
it directly (zero-copy calls on buffers the client's platform wraps)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvfabric.bench.poolcase import Op
from kvfabric.bench.stores import chunks, die_with_parent


def missing() -> str | None:
    return None


class Service:
    """A pool daemon subprocess; ``params``: its socket. ``stop()`` sends SIGTERM."""

    def __init__(self, capacity: int, workdir: str, options: dict[str, Any]) -> None:
        name = f"bench{os.getpid()}-{int(time.time() * 1000) % 100000}"
        self.socket = str(Path(workdir) / f"{name}.sock")
        settings = {
            "name": name,
            "dram": int(capacity),
            "socket": self.socket,
            "max_objects": int(options.get("max_objects", 1 << 18)),
            **{k: v for k, v in options.items() if k != "max_objects"},
        }
        cfg = Path(workdir) / f"{name}.yaml"
        cfg.write_text("".join(f"{k}: {v}\n" for k, v in settings.items()))
        self.log = Path(workdir) / f"{name}.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvfabric.cli", "pool", "serve", "--config", str(cfg)],
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                preexec_fn=die_with_parent,
            )
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line.startswith("{"):
            self.proc.kill()
            self.proc.wait()
            err = self.log.read_text()[-2000:]
            raise RuntimeError(f"pool daemon did not start: {line.strip()} {err.strip()}")
        self.ready = json.loads(line)
        self.params = {"socket": self.socket}
        self.pids = [self.proc.pid]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def start(capacity: int, workdir: str, options: dict[str, Any] | None = None) -> Service:
    return Service(capacity, workdir, options or {})


class Driver:
    """A pool client (see the store contract in ``kvfabric.bench.stores``)."""

    def __init__(self, params: dict[str, Any]) -> None:
        from kvfabric.pool import connect

        self.client = connect(params["socket"], timeout=float(params.get("timeout", 30.0)))
        self._bufs: list[Any] = []
        self.last_failure = ""  # the statuses of the last call that failed, for the report

    def _failed(self, status: Any) -> int:
        from kvfabric.pool.status import Status

        st = np.atleast_1d(np.asarray(status, np.int64))
        bad = st[st != Status.OK]
        if bad.size:
            names = sorted({Status(int(x)).name for x in bad.tolist()})
            self.last_failure = f"pool status {'/'.join(names)}"
        return int(bad.size)

    def register(self, arr: np.ndarray) -> None:
        self._bufs.append(self.client.platform.wrap(arr))

    def set_verify(self, mode: str) -> None:
        from kvfabric.platform.checksum import Verify

        self.client.verify = Verify.parse(mode)

    def call(self, op: Op, keys: list[str], ptrs: np.ndarray, sizes: np.ndarray) -> Callable[[], int]:
        c = self.client
        k, m = ptrs.shape
        if op is Op.PUT:
            if k == 1 and m == 1:
                key, p, n = keys[0], int(ptrs[0, 0]), int(sizes[0])
                return lambda: self._failed(c.put_from(key, p, n))
            if k == 1:
                key, pv = keys[0], np.ascontiguousarray(ptrs[0])
                return lambda: self._failed(c.put_from_layers(key, pv, sizes))
            if m == 1:
                pv, sv = np.ascontiguousarray(ptrs[:, 0]), np.full(k, sizes[0], np.uint64)
                return lambda: self._failed(c.batch_put_from(keys, pv, sv))
            return lambda: self._failed(c.batch_put_from_layers(keys, ptrs, sizes))
        if op is Op.GET:
            want = int(sizes.sum())
            if k == 1 and m == 1:
                key, p, n = keys[0], int(ptrs[0, 0]), int(sizes[0])
                return lambda: int(c.get_into(key, p, n) != want)
            if k == 1:
                key, pv = keys[0], np.ascontiguousarray(ptrs[0])
                return lambda: int(c.get_into_layers(key, pv, sizes) != want)
            if m == 1:
                pv, sv = np.ascontiguousarray(ptrs[:, 0]), np.full(k, sizes[0], np.uint64)
                return lambda: self._failed(c.batch_get_into(keys, pv, sv))
            return lambda: self._failed(c.batch_get_into_layers(keys, ptrs, sizes))
        raise ValueError(f"kvfabric pool driver: no call for op {op!r}")

    def exists(self, keys: list[str]) -> int:
        return int(self.client.batch_exists(keys).sum())

    def remove(self, keys: list[str]) -> None:
        for part in chunks(keys, 4096):
            self.client.batch_remove(part)

    def close(self) -> None:
        for b in self._bufs:
            self.client.platform.free(b)
        self._bufs.clear()
        self.client.close()
