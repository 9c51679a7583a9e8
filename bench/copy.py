"""``kvfabric bench copy``: platform copy bandwidth next to numpy memcpy of the same bytes.

Cases: ``in-process`` (between two buffers of this process's platform) and
``cross-process`` (into and out of a window another process owns and exported). Each
size runs over a working set larger than the CPU caches (slots at increasing offsets, so
no copy reuses a cache-hot buffer) and every buffer is pre-touched, so neither side pays
page faults. The memcpy baseline is ``numpy.copyto`` between two pre-touched arrays of the
same working set, interleaved round by round with the measured copies so both see the
same machine load. Figures are medians over rounds. On ``sim`` a copy of 4 MiB or more is
split across ``copy_threads`` threads (``copy_threads`` in each row), while the baseline is
one ``numpy.copyto`` on one thread: from 16 MiB up the ratio measures that split too.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from kvfabric.bench.report import BenchContext, machine_note
from kvfabric.harness.peer import PeerWindow
from kvfabric.platform.registry import create
from kvfabric.platform.types import Direction, Medium

KiB, MiB = 1 << 10, 1 << 20
FULL_SIZES = [4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB]
QUICK_SIZES = [4 * KiB, 64 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB]
MAX_SLOTS = 1024


def _time_round(fns: list[Callable[[], Any]]) -> float:
    t0 = time.perf_counter()
    for f in fns:
        f()
    return (time.perf_counter() - t0) / len(fns)


def _measure(
    ours: list[Callable[[], Any]], base: list[Callable[[], Any]], rounds: int
) -> tuple[float, float]:
    """Median seconds per copy for ours and the baseline, rounds interleaved (ABAB)."""
    _time_round(ours[:2]), _time_round(base[:2])  # warm the call paths
    a, b = [], []
    for _ in range(rounds):
        a.append(_time_round(ours))
        b.append(_time_round(base))
    return statistics.median(a), statistics.median(b)


def run(ctx: BenchContext) -> Iterator[dict[str, Any]]:
    sizes = QUICK_SIZES if ctx.quick else FULL_SIZES
    ws = (128 if ctx.quick else 256) * MiB
    rounds = max(ctx.rounds, 5)
    plat = create(ctx.platform)
    peer = PeerWindow.start(plat.name, ws)
    try:
        src = plat.alloc(ws, Medium.DRAM)
        dst = plat.alloc(ws, Medium.HBM)
        remote = plat.import_handle(peer.handle)
        src.numpy()[:] = 1
        plat.copy(dst, src)
        plat.copy(remote, src)
        plat.copy(src, remote)
        base_a = np.ones(ws, np.uint8)
        base_b = np.zeros(ws, np.uint8)
        cost = getattr(plat, "config", None)
        note = machine_note()
        for size in sizes:
            slots = min(ws // size, MAX_SLOTS)
            offs = [i * size for i in range(slots)]
            base = [lambda o=o, n=size: np.copyto(base_b[o : o + n], base_a[o : o + n]) for o in offs]
            cases = {
                ("in-process", "h2d"): [(dst.at(o, size), src.at(o, size)) for o in offs],
                ("cross-process", "write"): [(remote.at(o, size), src.at(o, size)) for o in offs],
                ("cross-process", "read"): [(src.at(o, size), remote.at(o, size)) for o in offs],
            }
            for (case, op), pairs in cases.items():
                ours = [lambda d=d, s=s: plat.copy(d, s) for d, s in pairs]
                t, tb = _measure(ours, base, rounds)
                row: dict[str, Any] = {
                    "case": case,
                    "op": op,
                    "platform": plat.name,
                    "nbytes": size,
                    "working_set": slots * size,
                    "gbps": round(size / t / 1e9, 3),
                    "memcpy_gbps": round(size / tb / 1e9, 3),
                    "ratio_vs_memcpy": round(tb / t, 3),
                    "p50_us": round(t * 1e6, 2),
                    "memcpy_p50_us": round(tb * 1e6, 2),
                    "rounds": rounds,
                }
                if cost is not None and hasattr(cost, "cost_model"):
                    d = Direction.of(pairs[0][0].medium, pairs[0][1].medium)
                    row["sim_gbps"] = round(size / cost.cost_model.copy_seconds(d, size) / 1e9, 2)
                    row["cost_model"] = cost.cost_model.name
                if hasattr(plat, "copy_threads"):  # sim: copies of >= 4 MiB are split across threads
                    row["copy_threads"] = plat.copy_threads
                row.update(note)
                yield row
    finally:
        plat.close()
        peer.stop()
