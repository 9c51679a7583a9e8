"""Waiting for a pool daemon that should exit on its own (the idle exit of auto-started ones)."""

from __future__ import annotations

import os
import time


def gone(pid: int | None) -> bool:
    """The process exited (a zombie counts as exited: it holds nothing)."""
    if pid is None:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_gone(pid: int | None, socket: str, timeout: float = 30.0) -> None:
    """Until the daemon ``pid`` exited and its socket file is gone; AssertionError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not (gone(pid) and not os.path.exists(socket)):
        assert time.monotonic() < deadline, f"pool daemon {pid} ({socket}) still there after {timeout} s"
        time.sleep(0.05)
