"""Running a command inside a loopback-only network namespace (for the Mooncake engine).

Mooncake's transfer engine opens listeners on every interface whatever it is told, so
tests and benchmarks run it in a namespace whose only interface is ``lo``
(``unshare -n``, then ``ip link set lo up``), with ``MC_TCP_BIND_ADDRESS=127.0.0.1``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys


def why_not() -> str | None:
    """None when Mooncake can run here in a private namespace, else the reason."""
    if importlib.util.find_spec("mooncake") is None:
        return "mooncake is not installed (pip install 'kvfabric[mooncake]')"
    for tool in ("unshare", "ip"):
        if shutil.which(tool) is None:
            return f"{tool} not found (util-linux / iproute2)"
    r = subprocess.run(["unshare", "-n", "ip", "link", "set", "lo", "up"], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip() or r.returncode}"
    r = subprocess.run(
        [sys.executable, "-c", "import mooncake.engine"], capture_output=True, text=True, timeout=60
    )
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["?"])[-1]
        return f"mooncake.engine does not load (Debian libibverbs1/librdmacm1 missing?): {tail}"
    return None


def run_isolated(
    argv: list[str], timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run ``argv`` in a fresh loopback-only network namespace."""
    e = dict(os.environ)
    e.update({"MC_TCP_BIND_ADDRESS": "127.0.0.1", "GLOG_minloglevel": "2"})
    e.update(env or {})
    script = 'ip link set lo up && exec "$@"'
    return subprocess.run(
        ["unshare", "-n", "bash", "-c", script, "netns", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=e,
    )
