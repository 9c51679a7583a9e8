"""Waiting for a pool daemon that should exit on its own (the idle exit of auto-started ones)."""

from __future__ import annotations

import os
import re
import time

from kvfabric.pool.gva.rendezvous.peer import ProcState, process_state


def gone(pid: int | None) -> bool:
    """The process exited (a zombie counts as exited: it holds nothing)."""
    return pid is None or process_state(pid) is ProcState.DEAD


def wait_gone(pid: int | None, socket: str, timeout: float = 30.0) -> None:
    """Until the daemon ``pid`` exited and its socket file is gone; AssertionError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not (gone(pid) and not os.path.exists(socket)):
        assert time.monotonic() < deadline, (
            f"pool daemon {pid} ({socket}) still there after {timeout} s; {_log_tail(socket)}"
        )
        time.sleep(0.05)


def _log_tail(socket: str, lines: int = 15) -> str:
    """The end of an auto-started daemon's log (it names the clients keeping it), with
    whether each process it names is alive."""
    try:
        with open(f"{socket}.log", errors="replace") as f:
            tail = f.read().splitlines()[-lines:]
    except FileNotFoundError:
        return "no daemon log"
    pids = sorted({int(w) for line in tail for w in re.findall(r"pid (\d+)", line)})
    alive = ", ".join(f"{p} {'exited' if gone(p) else 'alive'}" for p in pids)
    return "its log ends:\n" + "\n".join(tail) + (f"\nprocesses: {alive}" if alive else "")
