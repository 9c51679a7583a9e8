"""Redis as a benchmark store: Debian's ``redis-server`` on 127.0.0.1 (no persistence)
and redis-py (with hiredis when installed) clients.

Operations as a KV connector would use Redis: a put ``SET``s the object's bytes straight
from the caller's buffer (a memoryview, no staging copy; a layered object is gathered
into one value first, Redis values being contiguous); a get ``GET``s the value and copies
it into the caller's buffer (scattered over the pieces for a layered object). A batch
is one pipeline (no MULTI). ``exists`` is a pipeline of ``EXISTS``.
"""

from __future__ import annotations

import ctypes
import importlib.util
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvfabric.bench.poolcase import Op
from kvfabric.bench.stores import chunks, die_with_parent
from kvfabric.harness.procs import free_port, stop_process

SERVER = "redis-server"


def missing() -> str | None:
    if shutil.which(SERVER) is None:
        return "redis-server is not installed (Debian: apt-get install redis-server)"
    if importlib.util.find_spec("redis") is None:
        return "redis-py is not installed (pip install 'kvfabric[peers]')"
    return None


class Service:
    """``redis-server`` bound to 127.0.0.1 on a free port, no RDB/AOF; ``maxmemory`` of
    3 x ``capacity`` (allocator size classes and per-key overhead) with noeviction, a
    guard that fails puts rather than letting a runaway run take the machine's memory."""

    def __init__(self, capacity: int, workdir: str, options: dict[str, Any]) -> None:
        self.port = free_port()
        self.log = Path(workdir) / f"redis-{self.port}.log"
        cmd = [
            SERVER,
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--dir", workdir,
            "--maxmemory", str(int(capacity * 3)),
            "--maxmemory-policy", "noeviction",
            "--logfile", str(self.log),
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=die_with_parent
        )
        self.params = {"host": "127.0.0.1", "port": self.port}
        self.pids = [self.proc.pid]
        import redis

        deadline = time.monotonic() + 20
        while True:
            try:
                redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1).ping()
                return
            except redis.exceptions.ConnectionError as e:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server did not start: {e}") from e
                time.sleep(0.05)

    def stop(self) -> None:
        stop_process(self.proc)


def start(capacity: int, workdir: str, options: dict[str, Any] | None = None) -> Service:
    return Service(capacity, workdir, options or {})


def _views(ptrs: np.ndarray, sizes: np.ndarray) -> list[memoryview]:
    return [
        memoryview((ctypes.c_char * int(n)).from_address(int(p))).cast("B")
        for p, n in zip(ptrs.tolist(), sizes.tolist())
    ]


class Driver:
    """A redis-py client (see the store contract in ``kvfabric.bench.stores``)."""

    def __init__(self, params: dict[str, Any]) -> None:
        import redis

        self.r = redis.Redis(host=params["host"], port=int(params["port"]), socket_timeout=60)
        self.r.ping()

    def register(self, arr: np.ndarray) -> None:
        pass  # Redis copies from and to any memory

    def call(self, op: Op, keys: list[str], ptrs: np.ndarray, sizes: np.ndarray) -> Callable[[], int]:
        r = self.r
        k, m = ptrs.shape
        views = [_views(ptrs[i], sizes) for i in range(k)]
        if op is Op.PUT:
            if k == 1:
                key, pieces = keys[0], views[0]
                return lambda: int(not r.set(key, pieces[0] if m == 1 else b"".join(pieces), nx=True))

            def put_batch() -> int:
                pipe = r.pipeline(transaction=False)
                for key, pieces in zip(keys, views):
                    pipe.set(key, pieces[0] if m == 1 else b"".join(pieces), nx=True)
                return sum(1 for ok in pipe.execute() if not ok)

            return put_batch
        if op is Op.GET:
            if k == 1:
                key, pieces = keys[0], views[0]
                return lambda: _scatter(r.get(key), pieces)

            def get_batch() -> int:
                pipe = r.pipeline(transaction=False)
                for key in keys:
                    pipe.get(key)
                return sum(_scatter(v, pieces) for v, pieces in zip(pipe.execute(), views))

            return get_batch
        raise ValueError(f"redis driver: no call for op {op!r}")

    def exists(self, keys: list[str]) -> int:
        pipe = self.r.pipeline(transaction=False)
        for key in keys:
            pipe.exists(key)
        return int(sum(pipe.execute()))

    def remove(self, keys: list[str]) -> None:
        for part in chunks(keys, 1024):
            self.r.delete(*part)

    def close(self) -> None:
        self.r.close()


def _scatter(value: bytes | None, pieces: list[memoryview]) -> int:
    """Copy ``value`` into the caller's pieces; 1 if it is missing or the wrong size."""
    if value is None or len(value) != sum(p.nbytes for p in pieces):
        return 1
    if len(pieces) == 1:
        pieces[0][:] = value
        return 0
    src, off = memoryview(value), 0
    for p in pieces:
        p[:] = src[off : off + p.nbytes]
        off += p.nbytes
    return 0
