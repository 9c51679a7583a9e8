"""Helper processes and ports on this host: a free loopback port, and stopping a child.

Used by the benchmarks' peer services (Redis, Mooncake's master and metadata server)
and by the tests' etcd. The caller owns every process it passes in.
"""

from __future__ import annotations

import socket
import subprocess


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (racy by nature: bind soon)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_process(proc: subprocess.Popen, timeout: float = 20.0) -> None:
    """``SIGTERM`` ``proc`` if it still runs, ``SIGKILL`` it after ``timeout`` s, reap it."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
