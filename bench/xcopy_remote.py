"""The remote cases of ``kvfabric bench xcopy``, run inside a loopback-only network namespace.

``bench/xcopy.py`` starts this module under ``unshare -n`` (the Mooncake engine listens
on every interface). This process is node A, a :class:`GvaPeer` is node B; writes of one
piece and of the 122-piece block, and a read of one piece (``remote-read``: bounded by
``GvaConfig.remote_read_timeout``, so through the transport's staging); every figure
sits next to Mooncake's ``TransferEngine`` called directly with the same bytes, between
the same buffers, interleaved round by round (``ratio_vs_engine``), and next to numpy
memcpy of the same bytes. Prints one JSON object per line.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np

from kvfabric.bench.gva_peer import GvaPeer
from kvfabric.bench.timing import measure
from kvfabric.bench.xcopy import BLOCK, KiB, MiB, block_layout, row
from kvfabric.platform.registry import create
from kvfabric.platform.types import CopyBatch, Medium

REMOTE = ("mapped", "remote")


def main(argv: list[str] | None = None) -> int:
    from kvfabric.pool.gva.config import GvaConfig
    from kvfabric.pool.gva.fabric import Fabric
    from kvfabric.pool.gva.rendezvous.server import RendezvousServer

    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--platform", default=None)
    args = p.parse_args(argv)
    rounds = max(args.rounds, 5)
    ws = (64 if args.quick else 128) * MiB
    with RendezvousServer() as srv:
        peer = GvaPeer.start(srv.url, ws, args.platform, node="node-b", transports=REMOTE)
        plat = create(args.platform)
        fab = Fabric.join(srv.url, plat, config=GvaConfig(node="node-a", transports=REMOTE))
        try:
            table = fab.wait_for(lambda t: peer.rank in t.ranks, 30)
            seg = table.segment(Medium.DRAM, peer.rank)
            route = seg.member.routes["mooncake"]
            raddr = seg.window.addr
            remote = seg.base
            te: Any = fab.transport("remote").engine.engine  # Mooncake's TransferEngine itself
            src = plat.alloc(ws, Medium.DRAM)
            src.numpy()[:] = 1
            base_a, base_b = np.ones(ws, np.uint8), np.zeros(ws, np.uint8)
            # --- 1 MiB, one piece
            size = 1 * MiB
            offs = [i * size for i in range(min(ws // size, 64))]
            ours = [lambda o=o: fab.xcopy_sync(remote + o, src.at(o, size), size) for o in offs]
            direct = [lambda o=o: te.transfer_sync_write(route, src.ptr + o, raddr + o, size) for o in offs]
            mem = [lambda o=o: np.copyto(base_b[o : o + size], base_a[o : o + size]) for o in offs]
            emit("remote", size, 1, ours, direct, mem, rounds)
            # --- 1 MiB read back: bounded (staging, then a copy to the caller) vs the engine's
            # own synchronous read straight into the same buffer
            back = plat.alloc(ws, Medium.DRAM)
            ours = [lambda o=o: fab.xcopy_sync(back.at(o, size), remote + o, size) for o in offs]
            direct = [lambda o=o: te.transfer_sync_read(route, back.ptr + o, raddr + o, size) for o in offs]
            emit("remote-read", size, 1, ours, direct, mem, rounds)
            # --- the 122-piece block: scattered local pieces -> one remote region
            total = int(sum(BLOCK))
            layer = 128 * KiB
            src_off, dst_off = block_layout(layer)
            span = len(BLOCK) * layer
            slots = max(min(ws // span, ws // total, 4), 1)
            sizes = np.array(BLOCK, np.uint64)
            batches = [
                CopyBatch(
                    dst_off + np.uint64(remote + k * total), src_off + np.uint64(src.ptr + k * span), sizes
                )
                for k in range(slots)
            ]
            lists = [
                (
                    (src_off + np.uint64(src.ptr + k * span)).tolist(),
                    (dst_off + np.uint64(raddr + k * total)).tolist(),
                )
                for k in range(slots)
            ]
            n_list = sizes.tolist()
            ours = [lambda b=b: fab.batch_xcopy_sync(b) for b in batches]
            direct = [
                lambda lo=lo, re=re: te.batch_transfer_sync_write(route, lo, re, n_list) for lo, re in lists
            ]
            mem = [
                lambda k=k: np.copyto(
                    base_b[k * total : (k + 1) * total], base_a[k * total : (k + 1) * total]
                )
                for k in range(slots)
            ]
            emit("remote-block", total, len(BLOCK), ours, direct, mem, rounds)
        finally:
            fab.leave()
            plat.close()
            peer.stop()
    return 0


def emit(case: str, nbytes: int, pieces: int, ours: list, direct: list, mem: list, rounds: int) -> None:
    for f in direct[:1]:
        if f() != 0:
            raise RuntimeError(f"{case}: Mooncake's engine refused the direct transfer")
    t = measure(ours, direct, rounds)  # ours vs the engine, interleaved
    tm = measure(ours[:2], mem, 3)  # memcpy of the same bytes, for scale
    r = row(case, nbytes, pieces, t, rounds, protocol="tcp", engine="mooncake")
    r["engine_gbps"] = r.pop("memcpy_gbps")
    r["ratio_vs_engine"] = r.pop("ratio_vs_memcpy")
    r["engine_p50_us"] = r.pop("memcpy_p50_us")
    r["memcpy_gbps"] = round(nbytes / tm.base_s / 1e9, 3)
    r["ratio_vs_memcpy"] = round(tm.base_s / t.ours_s, 3)
    print(json.dumps(r), flush=True)


if __name__ == "__main__":
    sys.exit(main())
