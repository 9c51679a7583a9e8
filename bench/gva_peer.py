"""A pool rank in another process, for the xcopy benchmark: joins, touches its window, waits.

``GvaPeer.start(url, nbytes, **config)`` spawns a fresh interpreter that joins the pool
at ``url`` with one DRAM window of ``nbytes`` (every page written once, so nobody pays
first-touch faults during a measurement) and stays a member until ``stop()``.
"""

from __future__ import annotations

from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from kvfabric.harness.peer import spawn_ready, stop_child


def _main(conn: Connection, url: str, nbytes: int, platform: str | None, cfg: dict[str, Any]) -> None:
    from kvfabric.pool.gva.config import GvaConfig
    from kvfabric.pool.gva.fabric import Fabric

    try:
        fab = Fabric.join(url, platform, {"dram": nbytes}, config=GvaConfig(**cfg))
    except Exception as e:  # noqa: BLE001 - reported to the parent
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    try:
        fab.window("dram").numpy()[:] = 1
        conn.send(("ready", fab.rank))
        conn.recv()  # any message (or EOF) means stop
    except (EOFError, OSError):
        pass
    finally:
        fab.leave()


@dataclass
class GvaPeer:
    proc: Any
    conn: Connection
    rank: int

    @classmethod
    def start(
        cls, url: str, nbytes: int, platform: str | None = None, timeout: float = 120.0, **cfg: Any
    ) -> GvaPeer:
        proc, parent, msg = spawn_ready(
            _main, (url, nbytes, platform, cfg), "kvfabric-gva-peer", timeout, "gva peer"
        )
        return cls(proc, parent, msg[1])

    def stop(self, timeout: float = 10.0) -> None:
        stop_child(self.proc, self.conn, "stop", timeout)
