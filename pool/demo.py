"""The pool's part of ``kvfabric demo``: KV-block-shaped objects through an embedded pool.

Puts and gets 64 DeepSeek-R1-shaped blocks (61 layers x (128 KiB + 16 KiB) = 122 pieces,
8.57 MiB each; ``blocks``: another count, e.g. ``kvfabric demo --quick``'s 8) with
``put_from_layers`` / ``get_into_layers``, checks every byte, and prints hit counts and
bandwidth next to a memcpy of the same bytes.
"""

from __future__ import annotations

import time

import numpy as np
from rich.console import Console
from rich.table import Table

from kvfabric.platform.base import Platform
from kvfabric.pool.config import PoolConfig
from kvfabric.pool.service.node import EmbeddedPool
from kvfabric.pool.status import Status

PIECES = np.array([128 << 10] * 61 + [16 << 10] * 61, np.uint64)
BLOCKS = 64


def run(con: Console, platform: Platform, blocks: int = BLOCKS) -> bool:
    """Print the pool's figures for ``blocks`` blocks; True when every byte came back."""
    if blocks < 1:
        raise ValueError(f"blocks must be >= 1, got {blocks}")
    block = int(PIECES.sum())
    cfg = PoolConfig(name="demo", dram=blocks * block + (64 << 20), max_objects=4096)
    with EmbeddedPool(cfg, platform) as pool:
        client = pool.client()
        try:
            return _exercise(con, client, block, blocks)
        finally:
            client.close()


def _exercise(con: Console, client: object, block: int, blocks: int) -> bool:
    c = client  # a PoolClient
    plat = c.platform
    rng = np.random.default_rng(3)
    src = rng.integers(0, 256, blocks * block, dtype=np.uint8)
    dst = np.zeros_like(src)
    plat.wrap(src)
    plat.wrap(dst)
    offs = np.concatenate([[0], np.cumsum(PIECES)[:-1]]).astype(np.uint64)
    keys = [f"demo/block{i}" for i in range(blocks)]
    P_src = np.uint64(src.ctypes.data) + np.arange(blocks, dtype=np.uint64)[:, None] * np.uint64(block) + offs
    P_dst = np.uint64(dst.ctypes.data) + np.arange(blocks, dtype=np.uint64)[:, None] * np.uint64(block) + offs
    dst[:] = 0
    t0 = time.perf_counter()
    st = c.batch_put_from_layers(keys, P_src, PIECES)
    t_put = time.perf_counter() - t0
    t0 = time.perf_counter()
    hits = c.batch_get_into_layers([*keys, "demo/absent"], np.vstack([P_dst, P_dst[:1]]), PIECES)
    t_get = time.perf_counter() - t0
    ok = bool((st == Status.OK).all()) and bool(np.array_equal(src, dst))
    scratch = np.empty_like(src)
    t0 = time.perf_counter()
    np.copyto(scratch, src)
    t_mem = time.perf_counter() - t0
    total = blocks * block
    t = Table(
        "pool step",
        "blocks",
        "hits",
        "GB/s",
        "memcpy GB/s",
        "check",
        title=f"embedded pool on {plat.name}: {blocks} blocks of {len(PIECES)} pieces "
        f"({block / 2**20:.2f} MiB each)",
    )
    t.add_row(
        "batch_put_from_layers",
        str(blocks),
        "-",
        f"{total / t_put / 1e9:.2f}",
        f"{total / t_mem / 1e9:.2f}",
        "all stored" if (st == Status.OK).all() else "FAILED",
    )
    t.add_row(
        "batch_get_into_layers",
        str(blocks + 1),
        str(int((hits == Status.OK).sum())),
        f"{total / t_get / 1e9:.2f}",
        f"{total / t_mem / 1e9:.2f}",
        "bytes match, 1 miss" if ok and hits[-1] == Status.NOT_FOUND else "MISMATCH",
    )
    con.print(t)
    return ok and hits[-1] == Status.NOT_FOUND
