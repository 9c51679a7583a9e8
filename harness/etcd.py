"""A real etcd server for tests and benchmarks: 127.0.0.1, free ports, a temporary data directory;
optionally serving clients over TLS with client certificates (``tls_files`` makes a CA and
the certificates with the ``openssl`` command)."""

from __future__ import annotations

import contextlib
import http.client
import shutil
import ssl
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator

from kvfabric.harness.procs import free_port, stop_process


def etcd_binary() -> str | None:
    return shutil.which("etcd")


def tls_files(d: str) -> dict[str, str]:
    """A CA and, signed by it, a server certificate for 127.0.0.1 and a client certificate,
    as PEM files in ``d``: keys ``ca``, ``server_cert``, ``server_key``, ``client_cert``,
    ``client_key``."""
    if shutil.which("openssl") is None:
        raise RuntimeError("openssl not found")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    f = {k: f"{d}/{k}.pem" for k in ("ca", "ca_key", "server_cert", "server_key")}
    f.update({k: f"{d}/{k}.pem" for k in ("client_cert", "client_key")})
    days = ("-days", "2")
    EC = ("ec", "-pkeyopt", "ec_paramgen_curve:prime256v1")  # fast to make, unlike RSA
    run("req", "-x509", "-newkey", *EC, "-nodes", *days, "-subj", "/CN=kvf-test-ca",
        "-keyout", f["ca_key"], "-out", f["ca"])  # fmt: skip
    ext = f"{d}/san.ext"
    with open(ext, "w") as e:
        e.write("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
    for who in ("server", "client"):
        csr = f"{d}/{who}.csr"
        run("req", "-newkey", *EC, "-nodes", "-subj", f"/CN={who}",
            "-keyout", f[f"{who}_key"], "-out", csr)  # fmt: skip
        run("x509", "-req", "-in", csr, "-CA", f["ca"], "-CAkey", f["ca_key"], "-CAcreateserial", *days,
            "-extfile", ext, "-out", f[f"{who}_cert"])  # fmt: skip
    return f


def _ready(port: int, tls: dict[str, str] | None = None) -> bool:
    try:
        if tls is None:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
        else:
            ctx = ssl.create_default_context(cafile=tls["ca"])
            ctx.load_cert_chain(tls["client_cert"], tls["client_key"])
            c = http.client.HTTPSConnection("127.0.0.1", port, timeout=1, context=ctx)
        c.request("POST", "/v3/maintenance/status", "{}")
        ok = c.getresponse().status == 200
        c.close()
        return ok
    except OSError:
        return False


@contextlib.contextmanager
def etcd_server(
    timeout: float = 30.0,
    tls: dict[str, str] | None = None,
    preexec_fn: Callable[[], None] | None = None,
) -> Iterator[str]:
    """Start etcd; yield its ``etcd://127.0.0.1:PORT`` url; stop and delete it afterwards.
    ``tls`` (``tls_files``): clients over HTTPS with a client certificate the CA signed.
    ``preexec_fn``: run in the child before etcd starts (e.g. ``PR_SET_PDEATHSIG``)."""
    exe = etcd_binary()
    if exe is None:
        raise RuntimeError("etcd binary not found (Debian package etcd-server)")
    with tempfile.TemporaryDirectory(prefix="kvf-etcd-") as d:
        for _attempt in range(3):
            client, peer = free_port(), free_port()
            scheme = "https" if tls else "http"
            secure = (
                [
                    *("--cert-file", tls["server_cert"], "--key-file", tls["server_key"]),
                    *("--client-cert-auth", "--trusted-ca-file", tls["ca"]),
                ]
                if tls
                else []
            )
            proc = subprocess.Popen(
                [
                    exe,
                    "--name",
                    "kvf-test",
                    "--data-dir",
                    f"{d}/data",
                    "--listen-client-urls",
                    f"{scheme}://127.0.0.1:{client}",
                    "--advertise-client-urls",
                    f"{scheme}://127.0.0.1:{client}",
                    *secure,
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
                preexec_fn=preexec_fn,
            )
            deadline = time.monotonic() + timeout
            while proc.poll() is None and time.monotonic() < deadline and not _ready(client, tls):
                time.sleep(0.05)
            if proc.poll() is None and _ready(client, tls):
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
