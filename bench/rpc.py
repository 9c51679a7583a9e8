"""``kvfabric bench rpc``: the pool's metadata round trips with and without the short spin.

A small ``put_from`` is two round trips to the pool daemon (alloc, commit) around one copy,
so it measures what waking up costs. Each condition runs a daemon and its client processes
twice, interleaved: once with both ends polling briefly before sleeping (the defaults:
``rpc_spin_us`` 100 on the daemon and in ``connect()``) and once sleeping at once (both 0).

Conditions: one client with the other core idle, one client with a spinning process keeping
the other core busy, and four clients. Each client process pre-touches and wraps its buffer,
puts untimed for 0.3 s (the daemon's spin governor decides once per 100 ms tick), waits on
a barrier, then times ``puts`` 64 KiB ``put_from`` calls of fresh keys (removing them,
untimed, every 64) and ``puts`` no-op RPCs (``batch_remove`` of an absent key).
Reported per condition: the medians over clients and rounds of each client's p50, for both
settings, and ``ratio_nospin_over_spin`` (above 1: the spin helps); ``detail`` carries the
condition, the counts, the no-op RPC ratio and the machine's load.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from kvfabric.bench.cpuload import spin_forever
from kvfabric.bench.report import BenchContext, machine_note

OBJECT = 64 << 10
CONDITIONS = (("1-client", 1, False), ("1-client-other-core-busy", 1, True), ("4-clients", 4, False))
SETTINGS = {"spin": 100.0, "nospin": 0.0}
WARMUP_S = 0.3  # untimed puts first: a long-running daemon has long decided whether to spin


def put_timer(c: Any, prefix: str) -> Callable[[int], float]:
    """A timed ``put_from`` of one ``OBJECT`` as key ``prefix/i`` (seconds), from a buffer
    of 64 objects written first (every page touched) and wrapped by ``c``'s platform; each
    64 keys put are removed again, so the pool stays small. The returned function owns the
    buffer."""
    buf = np.ones(64 * OBJECT, np.uint8)
    c.platform.wrap(buf)
    base = int(buf.ctypes.data)
    batch: list[str] = []

    def put(i: int, _owned: np.ndarray = buf) -> float:  # the default keeps the buffer alive
        key = f"{prefix}/{i}"
        t0 = time.perf_counter()
        c.put_from(key, base + (i % 64) * OBJECT, OBJECT)
        dt = time.perf_counter() - t0
        batch.append(key)
        if len(batch) == 64:
            c.batch_remove(batch)
            batch.clear()
        return dt

    return put


def _client(socket: str, spin_us: float, puts: int, wid: int, barrier: Any, out: Any) -> None:
    from kvfabric.pool import connect

    c = connect(socket, timeout=10.0, rpc_spin_us=spin_us)
    try:
        put = put_timer(c, f"rpc/{wid}")
        put_t: list[float] = []
        rpc_t: list[float] = []

        end = time.perf_counter() + WARMUP_S  # the daemon's spin governor settles meanwhile
        i = 0
        while time.perf_counter() < end:
            put(i)
            i += 1
        barrier.wait()
        for j in range(puts):
            put_t.append(put(i + j))
        for _ in range(puts):
            t0 = time.perf_counter()
            c.batch_remove(["rpc/absent"])
            rpc_t.append(time.perf_counter() - t0)
        out.put((float(np.median(put_t)), float(np.median(rpc_t))))
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        out.put(repr(e))
    finally:
        c.close()


def _round(clients: int, busy: bool, spin_us: float, puts: int, workdir: str) -> tuple[float, float]:
    """One daemon, ``clients`` processes: the medians of their put and RPC p50s (µs)."""
    from kvfabric.bench.stores.kvpool import start

    ctx = mp.get_context("spawn")
    svc = start(64 << 20, workdir, {"rpc_spin_us": spin_us, "max_objects": 4096})
    spinner = ctx.Process(target=spin_forever, daemon=True) if busy else None
    try:
        if spinner is not None:
            spinner.start()
        out, barrier = ctx.Queue(), ctx.Barrier(clients)
        procs = [
            ctx.Process(target=_client, args=(svc.socket, spin_us, puts, w, barrier, out), daemon=True)
            for w in range(clients)
        ]
        for p in procs:
            p.start()
        got = [out.get(timeout=300) for _ in procs]
        for p in procs:
            p.join(30)
        bad = [g for g in got if not isinstance(g, tuple)]
        if bad:
            raise RuntimeError(f"bench rpc: a client failed: {bad[0]}")
        return statistics.median(g[0] for g in got) * 1e6, statistics.median(g[1] for g in got) * 1e6
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.join()
        svc.stop()


def run(ctx: BenchContext) -> Iterator[dict[str, Any]]:
    puts = int(ctx.options.get("puts", 1000 if ctx.quick else 3000))
    rounds = int(ctx.options.get("rounds", 2 if ctx.quick else max(ctx.rounds, 3)))
    with tempfile.TemporaryDirectory(prefix="kvf-bench-rpc-") as workdir:
        for case, clients, busy in CONDITIONS:
            res: dict[str, list[tuple[float, float]]] = {k: [] for k in SETTINGS}
            for _ in range(rounds):  # interleaved, so both settings see the same machine
                for name, spin_us in SETTINGS.items():
                    res[name].append(_round(clients, busy, spin_us, puts, workdir))
            put = {k: statistics.median(r[0] for r in v) for k, v in res.items()}
            rpc = {k: statistics.median(r[1] for r in v) for k, v in res.items()}
            yield {
                "case": case,
                "put_p50_us_spin": round(put["spin"], 1),
                "put_p50_us_nospin": round(put["nospin"], 1),
                "ratio_nospin_over_spin": round(put["nospin"] / put["spin"], 2),
                "rpc_p50_us_spin": round(rpc["spin"], 1),
                "rpc_p50_us_nospin": round(rpc["nospin"], 1),
                "detail": {
                    "clients": clients,
                    "other_core_busy": busy,
                    "nbytes": OBJECT,
                    "puts": puts,
                    "rounds": rounds,
                    "rpc_ratio_nospin_over_spin": round(rpc["nospin"] / rpc["spin"], 2),
                    **machine_note(),
                },
            }
