"""``kvfabric demo``: the stack end to end on the embedded default, with its figures.

First the platform layer: a second process owns a shareable window and exports it; this
process maps it, writes and reads it with single and batched copies, and checks every
byte against the peer's own view of the memory. Then the pool: an embedded pool stores
and serves KV-block-shaped objects (``kvfabric.pool.demo``). Then, when vLLM is
installed, the KV connector inside a real vLLM engine (see ``demo_vllm.py``): time to
first token of a prompt cold and again warm through kvfabric; without vLLM it says how
to install it. ``quick`` (``kvfabric demo --quick``): the same steps and checks on less: a
32 MiB window, 8 pool blocks, the tiny random Llama with a 256-token prompt.
"""

from __future__ import annotations

import hashlib
import time

import numpy as np
from rich.console import Console
from rich.table import Table

from kvfabric.harness.peer import PeerWindow
from kvfabric.platform import shm
from kvfabric.platform.registry import create
from kvfabric.platform.types import CopyBatch, Medium

MiB = 1 << 20
WINDOW = 64 * MiB
QUICK_WINDOW = 32 * MiB  # the batched gather reads 122 pieces 256 KiB apart: 30.5 MiB
QUICK_POOL_BLOCKS = 8
# One DeepSeek-R1 KV block as published MemCache figures use it: 61 layers x (128 KiB + 16 KiB).
BLOCK_PIECES = [128 * 1024] * 61 + [16 * 1024] * 61


def run_demo(platform: str | None = None, quick: bool = False) -> int:
    """Run and print the demo (see module docstring); the exit status, 0 when every check held."""
    con = Console()
    window_bytes = QUICK_WINDOW if quick else WINDOW
    plat = create(platform)
    info = plat.info()
    con.print(f"[bold]kvfabric demo[/] on platform [bold]{plat.name}[/] ({info.runtime})")
    ok = True
    table = Table("step", "bytes", "time", "GB/s", "check")
    peer = PeerWindow.start(plat.name, window_bytes)
    try:
        window = plat.import_handle(peer.handle)
        con.print(
            f"peer process {peer.proc.pid} exported a {window_bytes // MiB} MiB "
            f"{Medium.HBM.value} window; mapped here at {window.ptr:#x}"
        )
        local = plat.alloc(window_bytes, Medium.DRAM)
        data = np.random.default_rng(7).integers(0, 256, window_bytes, dtype=np.uint8)
        local.numpy()[:] = data
        plat.copy(window, local)  # first touch of the mapping, not timed

        t0 = time.perf_counter()
        plat.copy(window, local)
        dt = time.perf_counter() - t0
        good = peer.request("digest", 0, window_bytes)[1] == hashlib.sha256(data.tobytes()).hexdigest()
        ok &= good
        table.add_row(
            "write into peer window",
            f"{window_bytes:,}",
            f"{dt * 1e3:.2f} ms",
            f"{window_bytes / dt / 1e9:.2f}",
            "peer digest matches" if good else "MISMATCH",
        )

        peer.request("fill", 0, window_bytes, 11)
        t0 = time.perf_counter()
        plat.copy(local, window)
        dt = time.perf_counter() - t0
        want = np.random.default_rng(11).integers(0, 256, window_bytes, dtype=np.uint8)
        good = bool(np.array_equal(local.numpy(), want))
        ok &= good
        table.add_row(
            "read peer-written window",
            f"{window_bytes:,}",
            f"{dt * 1e3:.2f} ms",
            f"{window_bytes / dt / 1e9:.2f}",
            "bytes match" if good else "MISMATCH",
        )

        sizes = np.array(BLOCK_PIECES, np.uint64)
        offs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.uint64)
        stride = np.uint64(256 * 1024)  # scattered sources, one per layer piece
        src = np.uint64(local.ptr) + np.arange(len(sizes), dtype=np.uint64) * stride
        batch = CopyBatch(np.uint64(window.ptr) + offs, src, sizes)
        t0 = time.perf_counter()
        plat.batch_copy(batch)
        dt = time.perf_counter() - t0
        total = int(sizes.sum())
        view = local.numpy()
        rel = (src - np.uint64(local.ptr)).tolist()
        expect = np.concatenate([view[s : s + n] for s, n in zip(rel, sizes.tolist())])
        good = peer.request("digest", 0, total)[1] == hashlib.sha256(expect.tobytes()).hexdigest()
        ok &= good
        table.add_row(
            f"batched gather of one block ({len(sizes)} pieces)",
            f"{total:,}",
            f"{dt * 1e3:.2f} ms",
            f"{total / dt / 1e9:.2f}",
            "peer digest matches" if good else "MISMATCH",
        )
        con.print(table)
        ledger = getattr(plat, "ledger", None)
        if ledger is not None:
            model = plat.config.cost_model.name  # type: ignore[attr-defined]
            t = Table(
                "direction",
                "copies",
                "bytes",
                "wall GB/s",
                f"simulated GB/s ({model})",
                title="sim cost model: wall time here vs modelled device time",
            )
            for row in ledger.totals():
                t.add_row(
                    row.direction.name,
                    str(row.copies),
                    f"{row.nbytes:,}",
                    f"{row.wall_gbps:.2f}",
                    f"{row.sim_gbps:.2f}",
                )
            con.print(t)
        from kvfabric.pool import demo as pool_demo

        ok &= pool_demo.run(con, plat, QUICK_POOL_BLOCKS if quick else pool_demo.BLOCKS)
    finally:
        plat.close()
        peer.stop()
    mine = shm.owned_names()
    con.print(f"shared-memory segments still owned by this process after close: {len(mine)}")
    ok &= not mine
    from kvfabric.demo_vllm import run_connector_demo

    ok &= run_connector_demo(con, quick=quick)
    con.print("[green]demo OK[/]" if ok else "[red]demo FAILED[/]")
    return 0 if ok else 1
