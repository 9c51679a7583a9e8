"""The cluster of ``kvfabric bench cluster``, run inside a loopback-only network namespace.

:func:`kvfabric.bench.cluster.run` starts ``python -m kvfabric.bench.cluster_host`` under
``unshare -n``; the request (JSON) comes on stdin, rows and progress go to stdout as lines
``MARK`` + JSON (``{"row": ...}``, ``{"progress": ...}``, ``{"error": ...}``). In here:

1. ``lo`` is brought up and no other interface may exist (Mooncake's engine listens on
   every interface);
2. a real etcd on 127.0.0.1;
3. three nodes, each its own UTS namespace (``unshare -u``, host name ``kvfc-nodeN``: the
   pool's node id is host name + boot id, so the ranks of different nodes never map each
   other's windows and move bytes through Mooncake's transfer engine) and its own
   shared-memory directory; on each, a pool daemon (``dram: 0``, ``leader_election``, a
   token, ``transports: mapped,remote``) and a client process with a window
   (:mod:`kvfabric.bench.cluster_client`), where that node's puts land;
4. per case (``follower``: the node of a standing-by daemon; ``leader``: the leader's
   node) the prefix-reuse workload, a kill -9 of the node's daemon and client, the
   failover, and the node's restart (see :mod:`kvfabric.bench.cluster`);
5. the cross-node put / get figures, and Mooncake Store's next to them in the same
   namespace.

Everything started here gets ``PR_SET_PDEATHSIG`` and is stopped in ``finally``; the outer
process removes the shared-memory directories.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from kvfabric.bench import cluster as cl
from kvfabric.bench.cluster_client import MARK as CLIENT_MARK
from kvfabric.bench.stores import die_with_parent
from kvfabric.harness.procs import stop_process

MARK = "kvfabric-cluster-host: "
TOKEN = "kvfabric-bench-cluster-token"
POOL = "bench-cluster"


def emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def progress(msg: str) -> None:
    emit({"progress": msg})


def in_node(hostname: str, argv: list[str]) -> list[str]:
    """``argv`` in a UTS namespace of its own named ``hostname`` (a node of its own)."""
    return ["unshare", "-u", "--", "bash", "-c", 'hostname "$0" && exec "$@"', hostname, *argv]


class Client:
    """A :mod:`~kvfabric.bench.cluster_client` process: one JSON command, one reply."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Any) -> None:
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=env,
            preexec_fn=die_with_parent,
        )
        self.pid = int(self.recv(120.0))

    def recv(self, timeout: float = 300.0) -> Any:
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"a cluster client exited (code {self.proc.poll()}); see the log")
            if line.startswith(CLIENT_MARK):
                msg = json.loads(line[len(CLIENT_MARK) :])
                if "error" in msg:
                    raise RuntimeError(msg["error"])
                return msg["ok"]

    def send(self, cmd: str, **args: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": cmd, **args}) + "\n")
        self.proc.stdin.flush()

    def ask(self, cmd: str, **args: Any) -> Any:
        self.send(cmd, **args)
        return self.recv()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("stop")
                self.proc.wait(15)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                pass
        stop_process(self.proc, 10)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


@dataclass
class NodeProcs:
    """One node: its name, shared-memory directory, daemon and client."""

    index: int
    shm: str
    daemon: subprocess.Popen | None = None
    ready: dict[str, Any] = field(default_factory=dict)
    client: Client | None = None
    rank: int = -1

    @property
    def name(self) -> str:
        return f"kvfc-node{self.index}"


class Cluster:
    """The etcd url, the three nodes and how to start, kill and ask them."""

    def __init__(self, req: dict[str, Any], etcd: str, workdir: str) -> None:
        self.req, self.etcd, self.workdir = req, etcd, workdir
        self.nodes = [NodeProcs(i, os.path.join(req["shm_base"], f"node{i}")) for i in range(3)]
        self.log = open(req["log"], "a")  # noqa: SIM115 - closed in stop(); the outer run keeps it on failure
        self.extra: list[Client] = []

    def env(self, node: NodeProcs) -> dict[str, str]:
        return {
            **os.environ,
            "KVFABRIC_SHM_DIR": node.shm,
            "MC_TCP_BIND_ADDRESS": "127.0.0.1",
            "GLOG_minloglevel": "2",
            cl.MARKER_ENV: self.req["run_id"],
        }

    def start_daemon(self, node: NodeProcs) -> None:
        os.makedirs(node.shm, exist_ok=True)
        cfg = os.path.join(self.workdir, f"{node.name}.yaml")
        settings = {
            "name": POOL,
            "dram": 0,
            "socket": os.path.join(self.workdir, f"{node.name}.sock"),
            "max_objects": 65536,
            "tcp": "127.0.0.1:0",
            "token": TOKEN,
            "rendezvous": self.etcd,
            "leader_election": "true",
            "leader_ttl_s": cl.LEADER_TTL_S,
            "write_lease_s": 1.0,
            "session_ttl_s": cl.SESSION_TTL_S,
            "pretouch": "false",
            "rpc_spin_us": 0,
            "transports": "mapped,remote",
        }
        with open(cfg, "w") as f:
            f.write("".join(f"{k}: {v}\n" for k, v in settings.items()))
        argv = in_node(node.name, [sys.executable, "-m", "kvfabric.cli", "pool", "serve", "--config", cfg])
        node.daemon = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=self.env(node),
            preexec_fn=die_with_parent,
        )

    def wait_daemon(self, node: NodeProcs, timeout: float = 90.0) -> None:
        assert node.daemon is not None and node.daemon.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = node.daemon.stdout.readline()
            if not line:
                raise RuntimeError(f"the pool daemon of {node.name} exited (code {node.daemon.poll()})")
            if line.startswith("{"):
                node.ready = json.loads(line)
                return
        raise TimeoutError(f"the pool daemon of {node.name} did not become ready")

    def start_client(self, node: NodeProcs, window: int) -> Client:
        argv = in_node(
            node.name,
            [
                sys.executable,
                "-m",
                "kvfabric.bench.cluster_client",
                "--etcd",
                self.etcd,
                "--pool",
                POOL,
                "--token",
                TOKEN,
                "--window",
                str(window),
            ],
        )
        return Client(argv, self.env(node), self.log)

    def info(self, node: NodeProcs) -> dict[str, Any] | None:
        """The node daemon's ``Info`` (None: it does not answer)."""
        from kvfabric.errors import ServiceUnavailable
        from kvfabric.pool import protocol as p
        from kvfabric.pool.client.rpc import SocketTransport

        if node.daemon is None or node.daemon.poll() is not None or not node.ready:
            return None
        t = SocketTransport(f"tcp://127.0.0.1:{node.ready['tcp_port']}", timeout=1.0, token=TOKEN)
        try:
            return dict(t.call(p.Info()).data)
        except ServiceUnavailable:
            return None
        finally:
            t.close()

    def leader(self, among: list[NodeProcs]) -> tuple[NodeProcs, dict[str, Any]] | None:
        for n in among:
            i = self.info(n)
            if i is not None and i.get("leader", {}).get("state") == "leader":
                return n, i
        return None

    def wait_leader(self, among: list[NodeProcs], timeout: float = 30.0) -> NodeProcs:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = self.leader(among)
            if got is not None:
                return got[0]
            time.sleep(0.05)
        raise TimeoutError("no pool daemon leads")

    def kill_node(self, node: NodeProcs) -> None:
        """kill -9 of the node's daemon and client, as close together as two calls go."""
        for pid in (node.daemon.pid if node.daemon else None, node.client.proc.pid if node.client else None):
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if node.daemon is not None:
            node.daemon.wait(30)
            if node.daemon.stdout is not None:
                node.daemon.stdout.close()
        if node.client is not None:
            node.client.kill()
            node.client.stop()
        node.daemon, node.client, node.ready, node.rank = None, None, {}, -1

    def stop(self) -> None:
        for c in self.extra:
            c.stop()
        for n in self.nodes:
            if n.client is not None:
                n.client.stop()
        for n in self.nodes:
            if n.daemon is not None:
                stop_process(n.daemon, 20)
                if n.daemon.stdout is not None:
                    n.daemon.stdout.close()
        self.log.close()


def _each(clients: list[Client], cmd: str, per: list[dict[str, Any]]) -> list[Any]:
    """The same command to several clients at once; their replies in order."""
    for c, args in zip(clients, per, strict=True):
        c.send(cmd, **args)
    return [c.recv() for c in clients]


def run_case(
    cluster: Cluster, case: str, plan: cl.Plan, rng: random.Random, replicas: int = 1
) -> dict[str, Any]:
    """One kill case on the running cluster, every put asking for ``replicas`` copies;
    its row (see ``kvfabric.bench.cluster``). The pool is emptied at the end."""
    nodes = cluster.nodes
    prefixes = list(range(plan.prefixes))
    w = {"case": f"{case}-r{replicas}", "blocks": plan.blocks, "size": plan.block_bytes}
    _each([n.client for n in nodes], "replicas", [{"n": replicas} for _ in nodes])  # type: ignore[misc]
    progress(
        f"{case}, replicas {replicas}: storing {plan.prefixes} prefixes of {plan.blocks} blocks from 3 nodes"
    )
    _each(
        [n.client for n in nodes],  # type: ignore[misc]
        "warm",
        [{**w, "prefixes": prefixes[i::3]} for i in range(3)],
    )
    sweep = {**w, "prefixes": prefixes, "reput": False}
    before = _each(
        [n.client for n in nodes],  # type: ignore[misc]
        "sweep",
        [{**sweep, "seed": rng.randrange(1 << 30)} for _ in nodes],
    )
    lead = cluster.wait_leader(nodes)
    victim = lead if case == "leader" else next(n for n in nodes if n is not lead)
    survivors = [n for n in nodes if n is not victim]
    progress(f"{case}: kill -9 of {victim.name} (daemon {'leads' if victim is lead else 'stands by'})")
    _each(
        [n.client for n in survivors],  # type: ignore[misc]
        "loop_start",
        [{**w, "prefixes": prefixes, "seed": rng.randrange(1 << 30)} for _ in survivors],
    )
    time.sleep(0.3)  # the survivors' calls are in flight at the kill
    dead_rank = victim.rank
    t_kill = time.time()
    cluster.kill_node(victim)
    _each([n.client for n in survivors], "mark", [{"t": t_kill} for _ in survivors])  # type: ignore[misc]
    led, settled = _wait_settled(cluster, survivors, dead_rank, timeout=30.0)
    failover_s = None if settled is None else round(settled - t_kill, 3)
    time.sleep(0.5)  # survivors' calls after the settling (re-registration with a new leader)
    during = [n.client.ask("loop_stop") for n in survivors]  # type: ignore[union-attr]
    after = _each(
        [n.client for n in survivors],  # type: ignore[misc]
        "sweep",
        [{**sweep, "seed": rng.randrange(1 << 30)} for _ in survivors],
    )
    progress(f"{case}: restarting {victim.name}")
    t_restart = time.monotonic()
    cluster.start_daemon(victim)
    cluster.wait_daemon(victim)
    victim.client = cluster.start_client(victim, plan.window_bytes)
    victim.rank = int(victim.client.ask("rank"))
    victim.client.ask("replicas", n=replicas)
    new = victim.client.ask(
        "new", case=w["case"], n=plan.rejoin_objects, size=plan.block_bytes, timeout_s=15.0
    )
    rejoin_s = round(time.monotonic() - t_restart, 3)
    seen = survivors[0].client.ask("check", keys=new["keys"], size=plan.block_bytes)  # type: ignore[union-attr]
    nodes[0].client.ask("clear")  # type: ignore[union-attr]
    return cl.failover_row(
        case=case,
        killed=cl.Killed(victim.name, "leader" if victim is lead else "follower"),
        before=[cl.Reads.of(n.name, b) for n, b in zip(nodes, before, strict=True)],
        after=[cl.Reads.of(n.name, a) for n, a in zip(survivors, after, strict=True)],
        during=[cl.Reads.of(n.name, d) for n, d in zip(survivors, during, strict=True)],
        failover_s=failover_s,
        leader_s=None if led is None else round(led - t_kill, 3),
        served_again_s=cl.served_again_s(during, t_kill),
        rejoin=cl.Rejoin(
            rejoin_s, int(new["accepted"]), plan.rejoin_objects, int(seen["hits"]), int(seen["dirty"])
        ),
        plan=plan,
        replicas=replicas,
    )


def _wait_settled(
    cluster: Cluster, survivors: list[NodeProcs], dead_rank: int, timeout: float
) -> tuple[float | None, float | None]:
    """Wall times when a survivor was first seen leading, and when one led with the dead
    node's client rank gone from the membership (None: not within ``timeout``)."""
    deadline, led = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        got = cluster.leader(survivors)
        if got is not None:
            led = led or time.time()
            if dead_rank not in got[1].get("ranks", []):
                return led, time.time()
        time.sleep(0.05)
    return led, None


def throughput(cluster: Cluster, plan: cl.Plan) -> list[dict[str, Any]]:
    """Cross-node put / get of the pool (a windowless client on node 0 into node 1's
    client window) next to Mooncake Store's (a client contributing nothing, a store
    process owning the segment), in this namespace."""
    a, b = cluster.nodes[0], cluster.nodes[1]
    progress(f"cross-node put/get: {plan.bw_objects} x {plan.bw_bytes >> 10} KiB, {plan.bw_rounds} rounds")
    c = cluster.start_client(a, 0)
    cluster.extra.append(c)
    ours = c.ask("bw", peer_rank=b.rank, n=plan.bw_objects, size=plan.bw_bytes, rounds=plan.bw_rounds)
    theirs: dict[str, Any] | None = None
    why = cl.mooncake_store_missing()
    if why is None:
        progress("Mooncake Store: master, metadata server, a store process, a client")
        try:
            theirs = _mooncake_bw(cluster, plan)
        except Exception as e:  # noqa: BLE001 - a peer that cannot run is a note
            why = f"failed: {type(e).__name__}: {e}"
    return cl.throughput_rows(ours, theirs, why, plan, b.rank)


def _mooncake_bw(cluster: Cluster, plan: cl.Plan) -> dict[str, Any]:
    from kvfabric.bench.stores import mooncake_host

    os.environ.update(mooncake_host.ENV)
    services = mooncake_host.Services(max(mooncake_host.MIN_SEGMENT, 2 * plan.bw_objects * plan.bw_bytes))
    try:
        env = {**os.environ, **mooncake_host.ENV, cl.MARKER_ENV: cluster.req["run_id"]}
        c = Client([sys.executable, "-m", "kvfabric.bench.cluster_client", "--mooncake"], env, cluster.log)
        try:
            return dict(
                c.ask("bw", peer_rank=-1, n=plan.bw_objects, size=plan.bw_bytes, rounds=plan.bw_rounds)
            )
        finally:
            c.stop()
    finally:
        services.stop()


def host_main(req: dict[str, Any]) -> None:
    from kvfabric.bench.stores.mooncake_host import _lo_up_and_alone
    from kvfabric.harness.etcd import etcd_server

    _lo_up_and_alone()
    plan = cl.Plan(**req["plan"])
    rng = random.Random(req.get("seed", 0))
    with tempfile.TemporaryDirectory(prefix="kvf-cluster-") as workdir:
        progress("starting etcd")
        with etcd_server(preexec_fn=die_with_parent) as etcd:
            cluster = Cluster(req, etcd, workdir)
            try:
                progress("starting 3 pool daemons (leader election through etcd)")
                for n in cluster.nodes:
                    cluster.start_daemon(n)
                for n in cluster.nodes:
                    cluster.wait_daemon(n)
                lead = cluster.wait_leader(cluster.nodes)
                progress(f"{lead.name} leads; starting a client on every node")
                for n in cluster.nodes:
                    n.client = cluster.start_client(n, plan.window_bytes)
                    n.rank = int(n.client.ask("rank"))
                time.sleep(1.1)  # the first leader's allocation grace (write_lease_s)
                for replicas in plan.replicas:
                    for case in plan.cases:
                        emit({"row": run_case(cluster, case, plan, rng, replicas)})
                for row in throughput(cluster, plan):
                    emit({"row": row})
            finally:
                cluster.stop()


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks
    try:
        host_main(json.loads(sys.stdin.read()))
    except Exception as e:  # noqa: BLE001 - reported to the benchmark as a line
        import traceback

        emit({"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]})


if __name__ == "__main__":
    main()
