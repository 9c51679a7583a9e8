"""``kvfabric bench kv-events``: what the pool daemon's KV events cost its puts.

Each round runs a daemon twice, interleaved: with ``kv_events_endpoint`` off and on (PUB
and replay on 127.0.0.1, a ``Subscriber`` in this process following every batch the whole
time). A client process pre-touches its buffer, puts untimed for 0.3 s, then times ``puts``
64 KiB ``put_from`` calls of fresh keys (removing them, untimed, every 64: each put is one
stored event, each removal 64 removed events). Reported: the medians over rounds of the
client's p50 put time off and on, ``ratio_on_over_off`` (1.0: free), and in ``detail`` the
batches and events the daemon published, what the subscriber applied, the gaps it repaired
and the batches it never got (``missing``, 0 when nothing was lost), with the machine's load.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from kvfabric.bench.report import BenchContext, machine_note
from kvfabric.bench.rpc import put_timer

WARMUP_S = 0.3
SETTINGS = ("off", "on")


def _client(socket: str, puts: int, out: Any) -> None:
    from kvfabric.pool import connect

    c = connect(socket, timeout=10.0)
    try:
        put = put_timer(c, "ev")
        end, i = time.perf_counter() + WARMUP_S, 0
        while time.perf_counter() < end:
            put(i)
            i += 1
        times = [put(i + j) for j in range(puts)]
        out.put(float(np.median(times)))
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        out.put(repr(e))
    finally:
        c.close()


def _round(on: bool, puts: int, workdir: str) -> tuple[float, dict[str, int]]:
    """One daemon, one client: its p50 put (µs) and, with events on, the stream's counts."""
    from kvfabric.bench.stores.kvpool import start
    from kvfabric.pool.kv_events import BlockSet, Subscriber

    opts: dict[str, Any] = {"max_objects": 4096}
    if on:
        opts.update(kv_events_endpoint="tcp://127.0.0.1:0", kv_events_replay_endpoint="tcp://127.0.0.1:0")
    svc = start(64 << 20, workdir, opts)
    stop = threading.Event()
    sub = Subscriber(svc.ready["kv_events_endpoint"], svc.ready["kv_events_replay_endpoint"]) if on else None
    blocks = BlockSet()
    applied = [0]

    def follow() -> None:
        while not stop.is_set() and sub is not None:
            applied[0] += sub.follow(blocks, 0.05)

    drain = threading.Thread(target=follow, daemon=True)
    try:
        drain.start()
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        proc = ctx.Process(target=_client, args=(svc.socket, puts, out), daemon=True)
        proc.start()
        got = out.get(timeout=300)
        proc.join(30)
        if not isinstance(got, float):
            raise RuntimeError(f"bench kv-events: the client failed: {got}")
        counts: dict[str, int] = {}
        if sub is not None:
            time.sleep(0.3)  # the last batches in flight
            stop.set()
            drain.join(10)
            applied[0] += sub.follow(blocks, 0.2)
            counts = {
                "applied": applied[0],
                "gaps": sub.gaps,
                "missing": sub.missing,
                "blocks": len(blocks.blocks),
            }
        return got * 1e6, counts
    finally:
        stop.set()
        if sub is not None:
            sub.close()
        svc.stop()


def run(ctx: BenchContext) -> Iterator[dict[str, Any]]:
    puts = int(ctx.options.get("puts", 1000 if ctx.quick else 3000))
    rounds = int(ctx.options.get("rounds", 2 if ctx.quick else max(ctx.rounds, 3)))
    res: dict[str, list[float]] = {k: [] for k in SETTINGS}
    stream: list[dict[str, int]] = []
    with tempfile.TemporaryDirectory(prefix="kvf-bench-events-") as workdir:
        for _ in range(rounds):  # interleaved, so both settings see the same machine
            for name in SETTINGS:
                p50, counts = _round(name == "on", puts, workdir)
                res[name].append(p50)
                if counts:
                    stream.append(counts)
    off, on = statistics.median(res["off"]), statistics.median(res["on"])
    yield {
        "case": "1-client-put_from-64KiB",
        "put_p50_us_off": round(off, 1),
        "put_p50_us_on": round(on, 1),
        "ratio_on_over_off": round(on / off, 3),
        "detail": {
            "puts": puts,
            "rounds": rounds,
            "put_p50_us_off_by_round": [round(x, 1) for x in res["off"]],
            "put_p50_us_on_by_round": [round(x, 1) for x in res["on"]],
            "batches_applied": [s["applied"] for s in stream],
            "gaps_repaired": [s["gaps"] for s in stream],
            "missing": [s["missing"] for s in stream],
            **machine_note(),
        },
    }
