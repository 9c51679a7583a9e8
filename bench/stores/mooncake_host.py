"""The Mooncake part of ``kvfabric bench pool``, inside a loopback-only network namespace.

Mooncake's transfer engine opens listeners on every interface whatever it is told, so
the benchmark never runs it in the machine's own network namespace: :func:`run` starts
``python -m kvfabric.bench.stores.mooncake_host`` under ``unshare -n`` (or ``unshare -rn``
where user namespaces are allowed and ``-n`` alone is not), which brings ``lo`` up,
refuses to go on if any other interface exists, and then, with
``MC_TCP_BIND_ADDRESS=127.0.0.1``:

1. starts the HTTP metadata server, the master (the packaged ``mooncake_master``
   binary), and a store process that contributes ``capacity`` bytes of segment;
2. measures the requested cases with client processes that contribute no memory
   (shape ``remote``: memory owned by another process, as the pool daemon owns it);
3. stops the store process and, if asked, measures the single-client cases again with a
   client that mounts its own segment (shape ``embedded``);
4. stops everything it started.

Protocol: the request (JSON) arrives on stdin; each result is printed as one line,
``MARK`` then JSON ``{"shape", "case", "result"}``; failures as ``{"event": "error", "message"}``. Mooncake's
own logging goes to stderr, which :func:`run` sends to a log file.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from kvfabric.bench.poolcase import Plan, case_from_dict, case_to_dict
from kvfabric.bench.stores import die_with_parent
from kvfabric.harness.procs import stop_process

METADATA_PORT, MASTER_PORT, METRICS_PORT = 18080, 50151, 19003
MIN_SEGMENT = 64 << 20  # Mooncake refuses very small segments
MARK = "kvfabric-mooncake: "  # prefix of result lines (anything else on stdout is ignored)
ENV = {
    "MC_TCP_BIND_ADDRESS": "127.0.0.1",
    # a batch of 32 blocks is 3904 pieces: let them queue instead of failing the transfer
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "16384",
    "KVF_MC_METADATA": f"http://127.0.0.1:{METADATA_PORT}/metadata",
    "KVF_MC_MASTER": f"127.0.0.1:{MASTER_PORT}",
}


# ---------------------------------------------------------------------- outside the namespace
def netns_prefix() -> list[str] | str:
    """The command prefix running a process in a fresh network namespace, or why none works."""
    errors = []
    for prefix in (["unshare", "-n", "--"], ["unshare", "-rn", "--"]):
        try:
            r = subprocess.run([*prefix, "true"], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired) as e:
            errors.append(f"{' '.join(prefix[:2])}: {e}")
            continue
        if r.returncode == 0:
            return prefix
        errors.append(f"{' '.join(prefix[:2])}: {r.stderr.strip()[:200]}")
    return "cannot create a network namespace (" + "; ".join(errors) + ")"


def run(request: dict[str, Any], log_path: str, timeout: float) -> Iterator[dict[str, Any]]:
    """Run the Mooncake part in a namespace; yield its JSON lines (see module docstring)."""
    prefix = netns_prefix()
    if isinstance(prefix, str):
        yield {"event": "error", "message": prefix}
        return
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "kvfabric.bench.stores.mooncake_host"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            preexec_fn=die_with_parent,
        )
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps(request))
        proc.stdin.close()
        deadline = time.monotonic() + timeout
        for line in proc.stdout:
            if line.startswith(MARK):
                yield json.loads(line[len(MARK) :])
            if time.monotonic() > deadline:
                yield {"event": "error", "message": f"Mooncake part ran past {timeout:.0f} s; stopped"}
                break
    finally:
        stop_process(proc, 60)
        if proc.stdout is not None:
            proc.stdout.close()


# ---------------------------------------------------------------------- inside the namespace
def _lo_up_and_alone() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifr = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(s, 0x8913, ifr))[1]  # SIOCGIFFLAGS
        fcntl.ioctl(s, 0x8914, struct.pack("16sh", b"lo", flags | 1))  # SIOCSIFFLAGS |= IFF_UP
    others = sorted({name for _, name in socket.if_nameindex()} - {"lo"})
    if others:
        raise RuntimeError(f"not a loopback-only network namespace (interfaces {others}); refusing")


def _wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start listening on 127.0.0.1:{port}") from None
            time.sleep(0.05)


class Services:
    """Metadata server, master and store process of one run (stopped in reverse order)."""

    def __init__(self, capacity: int) -> None:
        import mooncake

        self.procs: list[subprocess.Popen] = []
        try:
            host = ["--host", "127.0.0.1", "--port", str(METADATA_PORT)]
            meta = self._spawn([sys.executable, "-m", "mooncake.http_metadata_server", *host])
            _wait_port(METADATA_PORT, meta, "Mooncake metadata server")
            master = self._spawn(
                [
                    os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master"),
                    "--rpc_address=127.0.0.1",
                    f"--rpc_port={MASTER_PORT}",
                    "--metrics_host=127.0.0.1",
                    f"--metrics_port={METRICS_PORT}",
                ]  # the default read lease (a short one expires under load: LEASE_EXPIRED)
            )
            _wait_port(MASTER_PORT, master, "Mooncake master")
            self.store = self._spawn(
                [sys.executable, "-m", "kvfabric.bench.stores.mooncake_host", "--store", str(capacity)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
            line = self.store.stdout.readline() if self.store.stdout else ""
            if line.strip() != "ready":
                raise RuntimeError(
                    f"Mooncake store process did not start (exit code {self.store.wait(30)}; "
                    "its log is in the benchmark's mooncake.log)"
                )
        except BaseException:
            self.stop()
            raise

    def _spawn(self, cmd: list[str], **kw: Any) -> subprocess.Popen:
        kw.setdefault("stdout", sys.stderr)  # keep stdout for result lines
        proc = subprocess.Popen(cmd, text=True, preexec_fn=die_with_parent, **kw)
        self.procs.append(proc)
        return proc

    def stop_store(self) -> None:
        if self.store.poll() is None and self.store.stdin is not None:
            self.store.stdin.close()  # the store process unmounts and exits on EOF
            try:
                self.store.wait(30)
            except subprocess.TimeoutExpired:
                self.store.kill()

    def stop(self) -> None:
        for proc in reversed(self.procs):
            stop_process(proc)
            for f in (proc.stdin, proc.stdout):
                if f is not None:
                    f.close()
        self.procs = []


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _measure(shape: str, params: dict[str, Any], plan: Plan) -> None:
    from kvfabric.bench.poolrunner import Runner

    runner = Runner("mooncake", params, plan.client_capacities())
    try:
        runner.warm(plan.working_set)
        for case in plan.cases:
            res = runner.run(case, plan)
            _emit({"shape": shape, "case": case_to_dict(case), "result": res.to_dict()})
    finally:
        runner.close()


def host_main(request: dict[str, Any]) -> None:
    os.environ.update(ENV)
    _lo_up_and_alone()
    plan = Plan(
        working_set=int(request["working_set"]),
        rounds=int(request["rounds"]),
        round_s=float(request["round_s"]),
        cases=tuple(case_from_dict(c) for c in request["cases"]),
    )
    capacity = max(plan.store_capacity(), MIN_SEGMENT)
    services = Services(capacity)
    try:
        _measure("remote", {"segment": 0}, plan)
        services.stop_store()
        single = tuple(c for c in plan.cases if c.clients == 1)
        if request.get("embedded") and single:
            _measure("embedded", {"segment": capacity}, dataclasses.replace(plan, cases=single))
    finally:
        services.stop()


def store_main(capacity: int) -> None:
    """The process that contributes the segment; exits when stdin closes."""
    os.environ.update(ENV)
    from kvfabric.bench.stores.mooncake import setup_store

    store = setup_store(capacity)
    print("ready", flush=True)
    sys.stdin.read()
    store.close()


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks: stop services
    if len(sys.argv) == 3 and sys.argv[1] == "--store":
        store_main(int(sys.argv[2]))
        return
    try:
        with tempfile.TemporaryDirectory(prefix="kvf-mc-") as d:
            os.chdir(d)
            host_main(json.loads(sys.stdin.read()))
    except Exception as e:  # noqa: BLE001 - reported to the benchmark as a line
        _emit({"event": "error", "message": f"{type(e).__name__}: {e}"})


if __name__ == "__main__":
    main()
