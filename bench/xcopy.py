"""``kvfabric bench xcopy``: GVA copies next to numpy memcpy and Mooncake's own engine.

Cases (every row: ``nbytes``, ``pieces``, ``gbps``, ``memcpy_gbps``, ``ratio_vs_memcpy``,
``p50_us``, ``p99_us``, plus the CPU load it was taken under):

* ``mapped``: one piece, 64 KiB to 64 MiB, from a local buffer into the window of a
  rank in another process (mapped here), ``xcopy_sync`` per call. Baseline:
  ``numpy.copyto`` of the same bytes between the same memory (numpy views of the source
  buffer and of the mapped window), alternated call by call with ours. The fabric's own
  share: ``platform_copy_ratio_vs_memcpy`` / ``platform_copy_p50_us``, the same copies
  through ``Platform.copy`` onto spans resolved beforehand (no GVA decode, version check
  or pin), against the same baseline.
* ``mapped-block``: ``batch_xcopy_sync`` of one DeepSeek-R1 KV block as published
  MemCache figures use it, 61 x 128 KiB + 61 x 16 KiB = 122 pieces (8.57 MiB), from
  scattered local pieces into one region of the other process's window. Baseline
  (``memcpy_gbps``): numpy copies of the same 122 pieces with the same layout between the
  same two buffers; a stricter one (``memcpy_contiguous_gbps``, ``ratio_vs_contiguous``):
  one contiguous memcpy of as many bytes.
* ``remote`` / ``remote-block``: 1 MiB and the 122-piece block through the Mooncake
  transfer engine (TCP on loopback) to a rank on another "node", next to the same engine
  called directly with the same bytes (``ratio_vs_engine``). Runs in a loopback-only
  network namespace (``bench/xcopy_remote.py``, re-executed under ``unshare -n``); the
  row says why when that is not possible.

Working sets are larger than the CPU caches (slots at increasing offsets) and every
buffer is pre-touched.

Pages (the ``pages`` field of the mapped rows): one peer rank per page kind this machine
gives a shared window now (``4k``; ``thp`` with ``shmem_enabled`` = advise or always;
``hugetlb`` with enough reserved pages free; ``bench/pages.py``), measured size by size in
the same run, each next to numpy memcpy into that same window; a kind not available is a
row with ``skipped`` and the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

from kvfabric.bench import pages as pg
from kvfabric.bench.gva_peer import GvaPeer
from kvfabric.bench.report import BenchContext, machine_note
from kvfabric.bench.timing import Timing, load_note, measure
from kvfabric.platform.registry import create
from kvfabric.platform.types import CopyBatch, Medium

KiB, MiB = 1 << 10, 1 << 20
FULL_SIZES = [64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB]
QUICK_SIZES = [64 * KiB, 1 * MiB, 4 * MiB, 64 * MiB]
MAX_SLOTS = 1024
BLOCK = [128 * KiB] * 61 + [16 * KiB] * 61


def row(case: str, nbytes: int, pieces: int, t: Timing, rounds: int, **extra: Any) -> dict[str, Any]:
    r: dict[str, Any] = {
        "case": case,
        "nbytes": nbytes,
        "pieces": pieces,
        "gbps": round(nbytes / t.ours_s / 1e9, 3),
        "memcpy_gbps": round(nbytes / t.base_s / 1e9, 3),
        "ratio_vs_memcpy": round(t.base_s / t.ours_s, 3),
        "p50_us": round(t.p50_us, 1),
        "p99_us": round(t.p99_us, 1),
        "memcpy_p50_us": round(t.base_p50_us, 1),
        "rounds": rounds,
    }
    r.update(extra)
    r.update(load_note(t.cpu_busy))
    r.update(machine_note())
    return r


def block_layout(slot_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Offsets of the 122 pieces in scattered local memory (each piece in its own "layer"
    region, as KV caches lay them out) and in the contiguous remote object."""
    sizes = np.array(BLOCK, np.uint64)
    dst_off = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.uint64)
    src_off = (np.arange(len(BLOCK), dtype=np.uint64) * np.uint64(slot_bytes)).astype(np.uint64)
    return src_off, dst_off


def run_mapped(ctx: BenchContext) -> Iterator[dict[str, Any]]:
    from kvfabric.pool.gva.fabric import Fabric
    from kvfabric.pool.gva.rendezvous.server import RendezvousServer

    sizes = QUICK_SIZES if ctx.quick else FULL_SIZES
    ws = (128 if ctx.quick else 256) * MiB
    rounds = max(ctx.rounds, 5)
    kinds, skipped = pg.kinds(ws, 1)
    yield from ({"case": "mapped", **r} for r in skipped)
    with RendezvousServer() as srv:
        peers: list[GvaPeer] = []
        plat = create(ctx.platform)
        fab = None
        try:
            for kind in kinds:
                with pg.peer_pages(kind):
                    peers.append(GvaPeer.start(srv.url, ws, ctx.platform))
            fab = Fabric.join(srv.url, plat)
            fab.wait_for(lambda t: all(p.rank in t.ranks for p in peers), 30)
            remotes = [fab.gva(Medium.DRAM, 0, rank=p.rank) for p in peers]
            src = plat.alloc(ws, Medium.DRAM)
            src.numpy()[:] = 1
            # The baseline copies between the same kinds of memory (numpy views of the source
            # buffer and of the peer's window mapped here; private numpy arrays would get huge
            # pages a 4k shared window does not have) but other slots of them, so neither side
            # finds the bytes the other just moved in the cache. Calls alternate A B A B.
            wins, kinds_of = [], []
            for remote in remotes:
                buf = fab.resolve(remote, ws).buffer
                wins.append(buf.numpy())
                kinds_of.append(pg.pages_of(buf))
                wins[-1][:] = 2  # touch the mapping here too
            srcv = src.numpy()
            for size in sizes:
                half = max(min(ws // size, 2 * MAX_SLOTS) // 2, 1)
                for remote, win, kind in zip(remotes, wins, kinds_of):
                    ours = [
                        lambda o=i * size, n=size, r=remote: fab.xcopy_sync(r + o, src.at(o, n), n)
                        for i in range(half)
                    ]
                    base = [
                        lambda o=(half + i) * size, n=size, w=win: np.copyto(w[o : o + n], srcv[o : o + n])
                        for i in range(half)
                    ]
                    # the fabric's share: Platform.copy straight onto the resolved span
                    spans = [fab.resolve(remote + i * size, size) for i in range(half)]
                    direct = [
                        lambda o=i * size, n=size, d=d: plat.copy(d, src.at(o, n), n)
                        for i, d in enumerate(spans)
                    ]
                    t = measure(ours, base, rounds)
                    tp = measure(direct, base, rounds)
                    huge = pg.huge_mapped_kib(int(win.ctypes.data))
                    yield row(
                        "mapped",
                        size,
                        1,
                        t,
                        rounds,
                        platform=plat.name,
                        pages=kind,
                        huge_mapped_kib=huge,
                        platform_copy_ratio_vs_memcpy=round(tp.base_s / tp.ours_s, 3),
                        platform_copy_p50_us=round(tp.p50_us, 1),
                    )
            for remote, win, kind in zip(remotes, wins, kinds_of):
                yield {**block_row(fab, plat.name, remote, src, win, srcv, ws, rounds), "pages": kind}
        finally:
            if fab is not None:
                fab.leave()
            plat.close()
            for peer in peers:
                peer.stop()


def block_row(
    fab: Any, platform: str, remote: int, src: Any, win: np.ndarray, srcv: np.ndarray, ws: int, rounds: int
) -> dict[str, Any]:
    """The 122-piece block: scattered local pieces -> one region of the peer's window.

    Ours uses the first ``slots`` blocks of both buffers, the baselines the ones after."""
    total = int(sum(BLOCK))
    layer = 128 * KiB
    src_off, dst_off = block_layout(layer)
    span = len(BLOCK) * layer
    slots = max(min((ws // 2) // span, 4), 1)
    sizes_arr = np.array(BLOCK, np.uint64)
    batches = [
        CopyBatch(dst_off + np.uint64(remote + k * total), src_off + np.uint64(src.ptr + k * span), sizes_arr)
        for k in range(slots)
    ]
    ours = [lambda b=b: fab.batch_xcopy_sync(b) for b in batches]
    s0, d0 = slots * span, slots * total  # the baselines' memory starts after ours
    pieces = [
        lambda k=k: [
            np.copyto(
                win[d0 + k * total + d : d0 + k * total + d + n],
                srcv[s0 + k * span + s : s0 + k * span + s + n],
            )
            for d, s, n in zip(dst_off.tolist(), src_off.tolist(), BLOCK)
        ]
        for k in range(slots)
    ]
    contiguous = [
        lambda k=k: np.copyto(
            win[d0 + k * total : d0 + (k + 1) * total], srcv[s0 + k * total : s0 + (k + 1) * total]
        )
        for k in range(slots)
    ]
    t = measure(ours, pieces, rounds)  # numpy memcpy of the same 122 pieces, same layout
    tc = measure(ours, contiguous, rounds)  # one contiguous memcpy of as many bytes
    return row(
        "mapped-block",
        total,
        len(BLOCK),
        t,
        rounds,
        platform=platform,
        memcpy_contiguous_gbps=round(total / tc.base_s / 1e9, 3),
        ratio_vs_contiguous=round(tc.base_s / tc.ours_s, 3),
    )


def run_remote_isolated(ctx: BenchContext) -> Iterator[dict[str, Any]]:
    """Re-run ``bench/xcopy_remote.py`` in a loopback-only network namespace."""
    import importlib.util

    why = None
    if importlib.util.find_spec("mooncake") is None:
        why = "mooncake is not installed (pip install 'kvfabric[mooncake]')"
    elif shutil.which("unshare") is None or shutil.which("ip") is None:
        why = "unshare/ip not found: cannot isolate the engine in a loopback-only namespace"
    if why is None:
        env = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1", GLOG_minloglevel="2")
        args = ["--rounds", str(ctx.rounds)] + (["--quick"] if ctx.quick else [])
        if ctx.platform:
            args += ["--platform", ctx.platform]
        cmd = [
            "unshare",
            "-n",
            "bash",
            "-c",
            'ip link set lo up && exec "$@"',
            "netns",
            sys.executable,
            "-m",
            "kvfabric.bench.xcopy_remote",
            *args,
        ]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
        except subprocess.TimeoutExpired:
            why = "the remote benchmark timed out"
        else:
            if r.returncode == 0:
                for line in r.stdout.splitlines():
                    if line.startswith("{"):
                        yield json.loads(line)
                return
            tail = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
            why = f"remote benchmark failed (needs root for unshare -n): {tail}"
    yield {"case": "remote", "skipped": why}


def run(ctx: BenchContext) -> Iterator[dict[str, Any]]:
    yield from run_mapped(ctx)
    if not ctx.options.get("mapped_only"):
        yield from run_remote_isolated(ctx)
