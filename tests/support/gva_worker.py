"""A pool rank in a child process, driven over a pipe by a test (multiprocessing spawn).

``Worker.start(url, windows, spec="sim", ...)`` spawns a fresh interpreter that builds the
platform ``spec`` (see ``platforms.py``), joins the pool with its windows (each filled
with ``pattern(nbytes, seed=rank)``), then runs commands:

* ``("xcopy", dst, src, n)`` / ``("batch", [(dst, src, n), ...])``: synchronous copies;
  the reply is ``("ok",)`` or ``("error", type name, message)``;
* ``("spin", pairs, seconds)``: copy repeatedly between the given (dst, src, n) until
  ``seconds`` pass; reply ``("ok", copies done, errors seen)``;
* ``("table",)``: reply ``("ok", version, ranks)``; ``("leave",)``: leave and exit.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np


def pattern(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _main(
    conn: Connection, url: str, windows: dict[str, int], cfg_kwargs: dict[str, Any], env: dict, spec: str
) -> None:
    os.environ.update(env)
    from platforms import build

    from kvfabric.errors import KVFabricError
    from kvfabric.pool.gva.config import GvaConfig
    from kvfabric.pool.gva.fabric import Fabric

    plat = build(spec)
    try:
        fab = Fabric.join(url, plat, windows, config=GvaConfig(**cfg_kwargs))
    except Exception as e:  # noqa: BLE001 - reported to the parent
        conn.send(("error", type(e).__name__, str(e)))
        plat.close()
        return
    for med in windows:
        w = fab.window(med)
        host = plat.alloc(w.nbytes, "dram")
        host.numpy()[:] = pattern(w.nbytes, fab.rank)
        plat.copy(w, host)  # device windows are filled through a host buffer
        plat.free(host)
    conn.send(("ready", fab.rank))
    try:
        while True:
            cmd, *args = conn.recv()
            try:
                if cmd == "xcopy":
                    fab.xcopy_sync(*args)
                    conn.send(("ok",))
                elif cmd == "batch":
                    fab.batch_xcopy_sync(args[0])
                    conn.send(("ok",))
                elif cmd == "spin":
                    pairs, seconds = args
                    done = errors = 0
                    end = time.monotonic() + seconds
                    while time.monotonic() < end:
                        for d, s, n in pairs:
                            try:
                                fab.xcopy_sync(d, s, n)
                                done += 1
                            except KVFabricError:
                                errors += 1
                    conn.send(("ok", done, errors))
                elif cmd == "members":  # wait until this rank's table lists that many
                    n, timeout = args
                    t = fab.wait_for(lambda t, n=n: len(t.members) >= n, timeout)
                    conn.send(("ok", len(t.members)))
                elif cmd == "table":
                    conn.send(("ok", fab.version, list(fab.table.ranks)))
                elif cmd == "leave":
                    fab.leave()
                    conn.send(("ok",))
                    return
                else:
                    conn.send(("error", "ValueError", f"unknown command {cmd!r}"))
            except Exception as e:  # noqa: BLE001 - every failure goes back to the test
                conn.send(("error", type(e).__name__, str(e)))
    except (EOFError, OSError):
        pass
    finally:
        fab.leave()
        plat.close()


@dataclass
class Worker:
    proc: Any
    conn: Connection
    rank: int

    @classmethod
    def start(
        cls, url: str, windows: dict[str, int], timeout: float = 60.0, spec: str = "sim", **cfg: Any
    ) -> Worker:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        env = {"KVFABRIC_SHM_DIR": os.environ.get("KVFABRIC_SHM_DIR", "/dev/shm")}
        proc = ctx.Process(target=_main, args=(child, url, windows, cfg, env, spec), daemon=True)
        proc.start()
        child.close()
        if not parent.poll(timeout):
            proc.kill()
            raise TimeoutError("worker did not join the pool in time")
        msg = parent.recv()
        if msg[0] != "ready":
            proc.join(10)
            raise RuntimeError(f"worker failed to join: {msg}")
        return cls(proc, parent, msg[1])

    def call(self, *cmd: Any, timeout: float = 60.0) -> tuple[Any, ...]:
        self.conn.send(cmd)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"worker rank {self.rank} did not answer {cmd[0]!r} within {timeout} s")
        return self.conn.recv()

    def ok(self, *cmd: Any, timeout: float = 60.0) -> tuple[Any, ...]:
        r = self.call(*cmd, timeout=timeout)
        assert r[0] == "ok", f"rank {self.rank}: {cmd[0]} failed: {r}"
        return r

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("leave", timeout=10)
            except (OSError, EOFError, TimeoutError):
                pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()
