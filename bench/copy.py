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

Pages (the ``pages`` field): the cross-process rows run once per page kind this machine
gives a shared window now (``4k``; ``thp`` with ``shmem_enabled`` = advise or always;
``hugetlb`` with enough reserved pages free; ``bench/pages.py``), one peer process per kind,
all in the same rounds next to the same baseline; a kind not available is a row with
``skipped`` and the reason. ``pages`` is what the mapped window really is on. The
in-process rows copy between private buffers (``pages`` says whether they ask for THP).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from kvfabric.bench import pages as pg
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
    kinds, skipped = pg.kinds(ws, 1)
    yield from ({"case": "cross-process", "platform": plat.name, **r} for r in skipped)
    peers: list[PeerWindow] = []
    try:
        for kind in kinds:
            with pg.peer_pages(kind):
                peers.append(PeerWindow.start(plat.name, ws))
        src = plat.alloc(ws, Medium.DRAM)
        dst = plat.alloc(ws, Medium.HBM)
        remotes = [plat.import_handle(p.handle) for p in peers]
        src.numpy()[:] = 1
        plat.copy(dst, src)
        for remote in remotes:
            plat.copy(remote, src)
            plat.copy(src, remote)
        private = "thp" if _thp_private() else "4k"
        base_a = np.ones(ws, np.uint8)
        base_b = np.zeros(ws, np.uint8)
        cost = getattr(plat, "config", None)
        note = machine_note()
        for size in sizes:
            slots = min(ws // size, MAX_SLOTS)
            offs = [i * size for i in range(slots)]
            base = [lambda o=o, n=size: np.copyto(base_b[o : o + n], base_a[o : o + n]) for o in offs]
            cases = {("in-process", "h2d", private): [(dst.at(o, size), src.at(o, size)) for o in offs]}
            for remote in remotes:
                kind = pg.pages_of(remote)
                cases[("cross-process", "write", kind)] = [
                    (remote.at(o, size), src.at(o, size)) for o in offs
                ]
                cases[("cross-process", "read", kind)] = [(src.at(o, size), remote.at(o, size)) for o in offs]
            huge = {}  # the window side's KiB on huge pages now (smaps), per case
            for (case, _op, _kind), pairs in cases.items():
                win = pairs[0][0] if case == "in-process" or _op == "write" else pairs[0][1]
                huge[id(pairs)] = pg.huge_mapped_kib(win.ptr)
            for (case, op, kind), pairs in cases.items():
                ours = [lambda d=d, s=s: plat.copy(d, s) for d, s in pairs]
                t, tb = _measure(ours, base, rounds)
                row: dict[str, Any] = {
                    "case": case,
                    "op": op,
                    "pages": kind,
                    "huge_mapped_kib": huge.get(id(pairs), 0),
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
        for peer in peers:
            peer.stop()


def _thp_private() -> bool:
    """Whether private buffers of 4 MiB and more get transparent huge pages (they ask)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False
