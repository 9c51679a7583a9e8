"""``kvfabric bench cluster``: the pool across three nodes, one of them killed.

Three "nodes" in one loopback-only network namespace (``unshare -n``; each node its own
UTS namespace, so its own host name and pool node id, and its own shared-memory
directory): a real etcd, one pool daemon per node campaigning for the leadership
(``leader_election``, a token over TCP), a client with a window on every node, Mooncake's
transfer engine for the bytes between nodes (:mod:`kvfabric.bench.cluster_host` runs it).

The workload, per case (``kill-follower``: the node of a daemon that stands by;
``kill-leader``: the leader's node):

1. **store**: ``prefixes`` prefixes of ``blocks`` blocks; node ``i`` puts prefixes
   ``i, i + 3, ...``, so each node's window holds a third of them;
2. **before**: every client reads every prefix once (shuffled; batch gets of a prefix's
   blocks), nothing put back: its hit rate;
3. **kill -9** of the node's daemon and client while the survivors keep calling (reads of
   random prefixes and a put of a fresh key after each: the calls across the failover,
   ``during``). ``failover_s``: from the kill until a surviving daemon leads and the dead
   client's rank has left the membership (its objects are out of the directory);
   ``leader_s``: until a surviving daemon was first seen leading (the leader key's TTL
   and a campaign when the leader died; at once otherwise); ``served_again_s``: until a
   survivor's put was accepted again;
4. **after**: every survivor reads every prefix once again, nothing put back;
5. **rejoin**: the node's daemon and client restart; its client puts
   ``rejoin_objects`` fresh objects (retrying while the leader's allocation grace lasts)
   and another node reads them back.

Every read is compared with the hash of the content its key must hold (a content
checksum per object): bytes that do not match are a *dirty read* (``dirty_reads``: all
phases), never a hit. ``max_call_s``: the longest client call of all phases.
Each case runs once per ``replicas`` value of the plan (1 and 2; every put of the run asks
for that many copies, which the leader places on distinct nodes): with 1 the objects of
the killed node's window are lost and the survivors' ``hit_rate_after`` shows that loss;
with 2 each of them has a copy on another node, which serves once the read of the dead
one failed (and, after a leader's death, once its owner re-registered it). Between runs
the pool is emptied (``remove_all``), so each starts from the same state.

The last rows: cross-node ``put`` and ``get`` GB/s (a client without a window on one node,
objects in another node's window; alloc there + write + commit, ``batch_get_into``)
next to Mooncake Store run in the same namespace in the same run (a client contributing
no memory, a store process owning the segment): ``ratio_vs_mooncake``. Without Mooncake
Store the row says why.

Cleaning up: every process gets ``PR_SET_PDEATHSIG`` and carries ``KVFABRIC_BENCH_CLUSTER``
(the run's id) in its environment; shared memory lies in
``/dev/shm/kvfabric-bench-cluster-<pid>``. A run first kills processes and removes
directories that a run no longer alive left (:func:`sweep_leftovers`), and does the same
for its own at the end, whatever happened.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from kvfabric.bench.report import BenchContext, machine_note

MARKER_ENV = "KVFABRIC_BENCH_CLUSTER"
SHM_PREFIX = "kvfabric-bench-cluster-"
LEADER_TTL_S = 2
SESSION_TTL_S = 3.0
REPLICAS = (1, 2)  # the runs of each case: copies of every object put
RUN_TIMEOUT_S = 1200.0
ROW_FIELDS = (
    "case",
    "replicas",
    "hit_rate_before",
    "hit_rate_after",
    "dirty_reads",
    "max_call_s",
    "failover_s",
)
CASES = ("follower", "leader")


@dataclass(frozen=True)
class Plan:
    """What one run does (sizes in bytes)."""

    prefixes: int = 200
    blocks: int = 4
    block_bytes: int = 64 << 10
    window_bytes: int = 128 << 20
    rejoin_objects: int = 16
    bw_objects: int = 16
    bw_bytes: int = 1 << 20
    bw_rounds: int = 5
    cases: tuple[str, ...] = CASES
    replicas: tuple[int, ...] = REPLICAS

    def __post_init__(self) -> None:
        object.__setattr__(self, "cases", tuple(self.cases))
        object.__setattr__(self, "replicas", tuple(int(r) for r in self.replicas))
        for c in self.cases:
            if c not in CASES:
                raise ValueError(f"cluster case {c!r}: expected one of {', '.join(CASES)}")
        if not self.replicas or any(not 1 <= r <= 3 for r in self.replicas):
            raise ValueError(f"cluster replicas {self.replicas}: each 1, 2 or 3 (three nodes)")
        if min(self.prefixes, self.blocks, self.block_bytes, self.bw_objects, self.bw_rounds) < 1:
            raise ValueError(f"cluster plan needs positive counts and sizes: {self}")
        # each run starts from an empty pool; a node's share of one run, twice over
        need = 2 * self.prefixes * self.blocks * self.block_bytes * max(self.replicas) // 3
        if self.window_bytes < need:
            raise ValueError(f"window_bytes {self.window_bytes} < {need}: a node's share does not fit")


def make_plan(ctx: BenchContext) -> Plan:
    o = dict(ctx.options)
    base = Plan(block_bytes=32 << 10, window_bytes=64 << 20, bw_rounds=5) if ctx.quick else Plan(bw_rounds=9)
    known = {k: o[k] for k in asdict(base) if k in o}
    return Plan(**{**asdict(base), **known})


@dataclass(frozen=True)
class Reads:
    """One client's reads in one phase (block reads: a batch call counts each block)."""

    node: str
    lookups: int
    hits: int
    dirty: int
    unavailable: int
    calls: int
    max_call_s: float
    puts: int = 0
    puts_ok: int = 0
    first_put_ok_after: float = 0.0

    @staticmethod
    def of(node: str, t: dict[str, Any]) -> Reads:
        return Reads(
            node,
            int(t["lookups"]),
            int(t["hits"]),
            int(t["dirty"]),
            int(t["unavailable"]),
            int(t["calls"]),
            float(t["max_call_s"]),
            int(t.get("puts", 0)),
            int(t.get("puts_ok", 0)),
            float(t.get("first_put_ok_after", 0.0)),
        )


@dataclass(frozen=True)
class Killed:
    node: str
    role: str  # "leader" or "follower": what its daemon was when killed


@dataclass(frozen=True)
class Rejoin:
    """The killed node back: ``seconds`` from its restart until its client's puts were all
    accepted (or gave up), how many were, and what another node read of them."""

    seconds: float
    accepted: int
    asked: int
    read_by_other: int
    dirty: int


def hit_rate(reads: list[Reads]) -> float | None:
    """Hits over block lookups of ``reads`` together (None: no lookup)."""
    lookups = sum(r.lookups for r in reads)
    return round(sum(r.hits for r in reads) / lookups, 4) if lookups else None


def drop(before: float | None, after: float | None) -> float | None:
    """The relative drop of a hit rate, ``1 - after / before`` (None when undefined)."""
    if before is None or after is None or before <= 0:
        return None
    return round(1.0 - after / before, 4)


def served_again_s(during: list[dict[str, Any]], t_kill: float) -> float | None:
    """Seconds from the kill until the first survivor's put was accepted after it."""
    ts = [float(d.get("first_put_ok_after", 0.0)) for d in during]
    ts = [t for t in ts if t >= t_kill]
    return round(min(ts) - t_kill, 3) if ts else None


def failover_row(
    *,
    case: str,
    killed: Killed,
    before: list[Reads],
    after: list[Reads],
    during: list[Reads],
    failover_s: float | None,
    served_again_s: float | None,
    rejoin: Rejoin,
    leader_s: float | None = None,
    plan: Plan,
    replicas: int = 1,
) -> dict[str, Any]:
    """One kill case's row. ``hit_rate_before`` / ``after``: the survivors' (the same
    clients both times); ``clients``: each node's."""
    survivors = {r.node for r in after}
    before_s = [r for r in before if r.node in survivors]
    hb, ha = hit_rate(before_s), hit_rate(after)
    every = [*before, *during, *after]
    per_node = []
    for r in before:
        a = next((x for x in after if x.node == r.node), None)
        per_node.append(
            {
                "node": r.node,
                "hit_rate_before": hit_rate([r]),
                "hit_rate_after": hit_rate([a]) if a is not None else None,
                "killed": r.node == killed.node,
            }
        )
    return {
        "case": f"kill-{case}",
        "replicas": replicas,
        "hit_rate_before": hb,
        "hit_rate_after": ha,
        "hit_rate_drop": drop(hb, ha),
        "dirty_reads": sum(r.dirty for r in every) + rejoin.dirty,
        "max_call_s": round(max((r.max_call_s for r in every), default=0.0), 3),
        "max_call_s_by_phase": {
            phase: round(max((r.max_call_s for r in rs), default=0.0), 3)
            for phase, rs in (("before", before), ("during", during), ("after", after))
        },
        "failover_s": failover_s,
        "leader_s": leader_s,
        "served_again_s": served_again_s,
        "killed": killed.node,
        "killed_role": killed.role,
        "unavailable_calls": sum(r.unavailable for r in every),
        "rejoin_s": rejoin.seconds,
        "rejoin_accepted": rejoin.accepted,
        "rejoin_read_by_other": rejoin.read_by_other,
        "rejoined": rejoin.accepted == rejoin.asked and rejoin.read_by_other == rejoin.asked,
        "clients": per_node,
        "during": {
            "reads": sum(r.lookups for r in during),
            "hits": sum(r.hits for r in during),
            "calls": sum(r.calls for r in during),
            "puts": sum(r.puts for r in during),
            "puts_ok": sum(r.puts_ok for r in during),
        },
        "detail": {
            **asdict(plan),
            "cases": list(plan.cases),
            "replicas": list(plan.replicas),
            **machine_note(),
        },
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def throughput_rows(
    ours: dict[str, Any], theirs: dict[str, Any] | None, why: str | None, plan: Plan, peer_rank: int
) -> list[dict[str, Any]]:
    """The cross-node ``put`` and ``get`` rows, Mooncake Store's figures beside ours."""
    rows = []
    for op in ("put", "get"):
        mc = theirs.get(f"{op}_gbps") if theirs else None
        rows.append(
            {
                "case": f"cross-node-{op}",
                "replicas": 1,
                "nbytes": plan.bw_bytes,
                "batch": plan.bw_objects,
                "gbps": ours[f"{op}_gbps"],
                "ratio_vs_mooncake": ratio(ours[f"{op}_gbps"], mc),
                "mooncake_gbps": mc,
                "mooncake": {
                    "status": "ok" if theirs else (why or "not measured"),
                    **(
                        {"failed": theirs["failed"], "wrong_rounds": theirs["wrong_rounds"]} if theirs else {}
                    ),
                },
                "detail": {
                    "rounds": plan.bw_rounds,
                    "failed": ours["failed"],
                    "wrong_rounds": ours["wrong_rounds"],
                    "placed_at_rank": ours.get("first_gva_rank"),
                    "peer_rank": peer_rank,
                    **machine_note(),
                },
            }
        )
    return rows


def mooncake_store_missing() -> str | None:
    """None when Mooncake Store (the store API and the packaged master) can run here."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or importlib.util.find_spec("mooncake.store") is None:
        return "Mooncake Store is not installed (mooncake.store)"
    master = os.path.join(os.path.dirname(spec.origin or ""), "mooncake_master")
    if not os.path.exists(master):
        return f"the packaged mooncake_master binary is missing ({master})"
    return None


# ---------------------------------------------------------------------- leftovers
def _environ_marker(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return None
    tag = MARKER_ENV.encode() + b"="
    for e in env:
        if e.startswith(tag):
            return e[len(tag) :].decode(errors="replace")
    return None


def _alive(run_id: str) -> bool:
    """Whether the benchmark process of ``run_id`` (its pid) still runs."""
    try:
        with open(f"/proc/{int(run_id)}/cmdline", "rb") as f:
            return b"kvfabric" in f.read()
    except (OSError, ValueError):
        return False


def sweep_leftovers(only: str | None = None) -> list[str]:
    """Kill the processes and remove the shared-memory directories of cluster runs whose
    benchmark process is gone (``only``: those of that run, alive or not). What it did."""
    done = []
    me = os.getpid()
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == me:
            continue
        run_id = _environ_marker(int(d))
        if run_id is None or (only is not None and run_id != only) or (only is None and _alive(run_id)):
            continue
        try:
            os.kill(int(d), signal.SIGKILL)
            done.append(f"killed pid {d} (run {run_id})")
        except ProcessLookupError:
            pass
    for name in os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else ():
        if not name.startswith(SHM_PREFIX):
            continue
        run_id = name[len(SHM_PREFIX) :]
        if (only is not None and run_id != only) or (only is None and _alive(run_id)):
            continue
        shutil.rmtree(os.path.join("/dev/shm", name), ignore_errors=True)
        done.append(f"removed /dev/shm/{name}")
    return done


# ---------------------------------------------------------------------- the run
def _note(msg: str) -> None:
    sys.stderr.write(f"[bench cluster] {msg}\n")
    sys.stderr.flush()


def why_not() -> str | None:
    """None when the cluster can run here, else the reason."""
    from kvfabric.harness.etcd import etcd_binary
    from kvfabric.harness.netns import why_not as netns_why_not

    if etcd_binary() is None:
        return "etcd not found (Debian package etcd-server)"
    if shutil.which("unshare") is None:
        return "unshare not found (util-linux)"
    return netns_why_not()


def run(ctx: BenchContext) -> Iterator[dict[str, Any]]:
    plan = make_plan(ctx)
    why = why_not()
    if why is not None:
        yield {"case": "skipped", "replicas": list(plan.replicas), "note": why}
        return
    for line in sweep_leftovers():
        _note(f"leftover of an earlier run: {line}")
    from kvfabric.bench.cluster_host import MARK
    from kvfabric.bench.stores import die_with_parent
    from kvfabric.harness.procs import stop_process

    run_id = str(os.getpid())
    log = os.path.join(tempfile.gettempdir(), f"kvfabric-bench-cluster-{run_id}.log")
    req = {
        "plan": asdict(plan),
        "run_id": run_id,
        "shm_base": f"/dev/shm/{SHM_PREFIX}{run_id}",
        "log": log,
        "seed": int(ctx.options.get("seed", 0)),
    }
    env = {**os.environ, MARKER_ENV: run_id}
    error = ""
    t0 = time.monotonic()
    with open(log, "w") as logf:
        proc = subprocess.Popen(
            ["unshare", "-n", "--", sys.executable, "-m", "kvfabric.bench.cluster_host"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=logf,
            text=True,
            env=env,
            preexec_fn=die_with_parent,
        )
    # a cluster that stops answering is stopped (SIGTERM: its finally blocks run) by the
    # watchdog, whether or not it prints
    watchdog = threading.Timer(RUN_TIMEOUT_S, proc.terminate)
    watchdog.daemon = True
    watchdog.start()
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps(req))
        proc.stdin.close()
        for line in proc.stdout:
            if not line.startswith(MARK):
                continue
            msg = json.loads(line[len(MARK) :])
            if "progress" in msg:
                _note(f"{time.monotonic() - t0:6.1f} s  {msg['progress']}")
            elif "row" in msg:
                yield msg["row"]
            elif "error" in msg:
                error = f"{msg['error']}\n{msg.get('trace', '')}"
    finally:
        watchdog.cancel()
        if time.monotonic() - t0 > RUN_TIMEOUT_S:
            error = f"the cluster ran past {RUN_TIMEOUT_S:.0f} s; stopped. {error}"
        stop_process(proc, 60)
        if proc.stdout is not None:
            proc.stdout.close()
        for line in sweep_leftovers(only=run_id):
            _note(f"cleaned up after this run: {line}")
    if error or proc.returncode not in (0, None):
        raise RuntimeError(f"kvfabric bench cluster failed: {error or proc.returncode} (log: {log})")
    os.unlink(log)
