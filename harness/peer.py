"""A second process that owns a shareable window, for cross-process benchmarks and demos.

``PeerWindow.start(...)`` spawns a fresh interpreter (``multiprocessing`` spawn) that
builds its own platform, allocates a shareable buffer, fills it, and sends back the
export handle; it keeps the buffer alive until ``stop()``. Commands over the pipe let the
parent ask the peer to fill or checksum a range with its own view of the memory.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from kvfabric.platform.types import Medium


def spawn_ready(
    target: Callable[..., None], args: tuple[Any, ...], name: str, timeout: float, what: str
) -> tuple[Any, Connection, tuple[Any, ...]]:
    """Spawn ``target(conn, *args)`` in a fresh interpreter and wait for its first message.

    The child sends ``("ready", ...)`` once set up, or anything else (``("error", why)``)
    when it could not be; returns ``(process, pipe, ready message)``. A child silent for
    ``timeout`` seconds is killed (``TimeoutError``); one that reports a failure is killed
    too (``RuntimeError`` with its message). The caller owns the process and the pipe.
    """
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), daemon=True, name=name)
    proc.start()
    child.close()
    if not parent.poll(timeout):
        proc.kill()
        raise TimeoutError(f"{what} did not get ready within {timeout} s")
    msg = parent.recv()
    if msg[0] != "ready":
        proc.kill()
        proc.join(10)
        raise RuntimeError(f"{what} failed: {msg[1:] if len(msg) > 1 else msg}")
    return proc, parent, msg


def stop_child(proc: Any, conn: Connection, message: Any, timeout: float = 10.0) -> None:
    """Ask a ``spawn_ready`` child to stop (``message`` on its pipe), kill it if it is still
    alive after ``timeout`` s, reap it and close the pipe; a child already gone is fine."""
    try:
        conn.send(message)
    except (BrokenPipeError, OSError):
        pass
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
    conn.close()


def _peer_main(conn: Connection, platform: str | None, nbytes: int, medium: str) -> None:
    import numpy as np

    from kvfabric.platform.registry import create

    plat = create(platform)
    try:
        buf = plat.alloc(nbytes, Medium(medium), shareable=True)
        host = plat.alloc(nbytes, Medium.DRAM)
        host.numpy()[:] = 0
        plat.copy(buf, host)  # touch every page of the window
        conn.send(("ready", plat.export_handle(buf), plat.name))
        while True:
            cmd, *args = conn.recv()
            if cmd == "stop":
                break
            if cmd == "fill":  # fill [off, off+n) with a seeded pattern
                off, n, seed = args
                pattern = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
                host.numpy()[:n] = pattern
                plat.copy(buf.at(off, n), host.at(0, n))
                conn.send(("ok",))
            elif cmd == "digest":
                off, n = args
                plat.copy(host.at(0, n), buf.at(off, n))
                conn.send(("ok", hashlib.sha256(host.numpy()[:n].tobytes()).hexdigest()))
            else:
                conn.send(("error", f"unknown command {cmd!r}"))
    finally:
        plat.close()
        conn.close()


@dataclass
class PeerWindow:
    """The parent's handle on a peer process and its exported window."""

    proc: Any
    conn: Connection
    handle: bytes
    platform: str
    nbytes: int

    @classmethod
    def start(
        cls, platform: str | None, nbytes: int, medium: Medium = Medium.HBM, timeout: float = 60.0
    ) -> PeerWindow:
        proc, parent, msg = spawn_ready(
            _peer_main, (platform, nbytes, medium.value), "kvfabric-peer", timeout, "peer process"
        )
        return cls(proc, parent, msg[1], msg[2], nbytes)

    def request(self, *cmd: Any) -> tuple[Any, ...]:
        self.conn.send(cmd)
        reply = self.conn.recv()
        if reply[0] != "ok":
            raise RuntimeError(f"peer refused {cmd[0]!r}: {reply}")
        return reply

    def stop(self, timeout: float = 10.0) -> None:
        stop_child(self.proc, self.conn, ("stop",), timeout)
