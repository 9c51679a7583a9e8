"""Two "nodes" on loopback move bytes through the remote (Mooncake) transport.

Run inside a loopback-only network namespace (``netns.run_isolated``). This process is
node A; a spawned worker is node B. Prints one JSON object with what was checked.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

from gva_worker import Worker, pattern

from kvfabric.errors import RankUnavailable
from kvfabric.pool.gva.config import GvaConfig
from kvfabric.pool.gva.fabric import Fabric
from kvfabric.pool.gva.rendezvous.server import RendezvousServer
from kvfabric.status import ItemStatus

WIN = 16 << 20
REMOTE = ("mapped", "remote")


def main() -> None:
    out: dict[str, object] = {}
    with RendezvousServer() as srv:
        b = Worker.start(srv.url, {"dram": WIN}, node="node-b", transports=REMOTE)
        a = Fabric.join(srv.url, "sim", {"dram": WIN}, config=GvaConfig(node="node-a", transports=REMOTE))
        try:
            a.wait_for(lambda t: len(t.members) == 2, 30)
            plat = a.platform
            gb = a.gva("dram", 0, rank=b.rank)
            out["route"] = a.table.member(b.rank).routes.get("mooncake", "")
            src = plat.alloc(WIN, "dram")
            src.numpy()[:] = pattern(WIN, 99)
            back = plat.alloc(WIN, "dram")
            # 1 MiB write, then read back
            a.xcopy_sync(gb + 4096, src, 1 << 20)
            a.xcopy_sync(back, gb + 4096, 1 << 20)
            out["write_read_1mib"] = bool((back.numpy()[: 1 << 20] == src.numpy()[: 1 << 20]).all())
            # the 122-piece block shape, asynchronous, local pieces -> one remote region
            sizes = [128 << 10] * 61 + [16 << 10] * 61
            offs = np.cumsum([0, *sizes[:-1]])
            base = 2 << 20
            items = [(gb + base + int(o), src.ptr + int(o) * 1, n) for o, n in zip(offs, sizes)]
            h = a.batch_xcopy(items)
            st = h.wait(60)
            out["batch_status_ok"] = bool(h.ok and (st == ItemStatus.OK).all())
            total = int(sum(sizes))
            a.xcopy_sync(back, gb + base, total)
            out["batch_bytes_ok"] = bool((back.numpy()[:total] == src.numpy()[:total]).all())
            # node B writes into A's window through its own engine (B is the near side)
            ga = a.gva("dram", 0)
            b.ok("xcopy", ga + 100, gb + base, 65536)
            out["b_to_a_ok"] = bool(
                (a.window("dram").numpy()[100 : 100 + 65536] == src.numpy()[:65536]).all()
            )
            # B untouched elsewhere: its own pattern still there past what we wrote
            a.xcopy_sync(back, gb + WIN - 4096, 4096)
            out["b_pattern_ok"] = bool((back.numpy()[:4096] == pattern(WIN, b.rank)[-4096:]).all())
            # node B dies: A notices and copies to it fail fast
            os.kill(b.proc.pid, signal.SIGKILL)
            t0 = time.monotonic()
            a.wait_for(lambda t: b.rank not in t.ranks, 15)
            out["leave_seen_s"] = round(time.monotonic() - t0, 3)
            try:
                a.xcopy_sync(gb, src, 4096)
                out["copy_to_dead"] = "no error"
            except RankUnavailable as e:
                out["copy_to_dead"] = f"RankUnavailable: {e}"
        finally:
            a.leave()
            b.stop()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
