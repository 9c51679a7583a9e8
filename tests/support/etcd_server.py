"""A real etcd server for tests: 127.0.0.1, free ports, a temporary data directory."""

from __future__ import annotations

import contextlib
import http.client
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator

from kvfabric.harness.procs import free_port, stop_process


def etcd_binary() -> str | None:
    return shutil.which("etcd")


def _ready(port: int) -> bool:
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
        c.request("POST", "/v3/maintenance/status", "{}")
        ok = c.getresponse().status == 200
        c.close()
        return ok
    except OSError:
        return False


@contextlib.contextmanager
def etcd_server(timeout: float = 30.0) -> Iterator[str]:
    """Start etcd; yield its ``etcd://127.0.0.1:PORT`` url; stop and delete it afterwards."""
    exe = etcd_binary()
    if exe is None:
        raise RuntimeError("etcd binary not found (Debian package etcd-server)")
    with tempfile.TemporaryDirectory(prefix="kvf-etcd-") as d:
        for _attempt in range(3):
            client, peer = free_port(), free_port()
            proc = subprocess.Popen(
                [
                    exe,
                    "--name",
                    "kvf-test",
                    "--data-dir",
                    f"{d}/data",
                    "--listen-client-urls",
                    f"http://127.0.0.1:{client}",
                    "--advertise-client-urls",
                    f"http://127.0.0.1:{client}",
                    "--listen-peer-urls",
                    f"http://127.0.0.1:{peer}",
                    "--initial-advertise-peer-urls",
                    f"http://127.0.0.1:{peer}",
                    "--initial-cluster",
                    f"kvf-test=http://127.0.0.1:{peer}",
                    "--log-level",
                    "error",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            deadline = time.monotonic() + timeout
            while proc.poll() is None and time.monotonic() < deadline and not _ready(client):
                time.sleep(0.05)
            if proc.poll() is None and _ready(client):
                break
            proc.kill()
            proc.wait()
            shutil.rmtree(f"{d}/data", ignore_errors=True)
        else:
            raise RuntimeError("etcd did not start on 127.0.0.1")
        try:
            yield f"etcd://127.0.0.1:{client}"
        finally:
            stop_process(proc, 10)
