"""The pool directory's size per object, measured on a daemon's real table.

A pool daemon with ``max_objects = objects`` is filled through its client API with
``fill`` one-byte objects (``batch_put_from``, 4096 keys per call: every key goes
through the meta service's alloc and commit like any put). Then:

* ``bytes_per_object``: the directory table segment minus its key arena, per object of
  capacity (header + slots: what the directory costs beyond the key strings);
* ``bytes_per_object_with_keys``: the whole segment (the arena is reserved up front);
* ``key_bytes_per_object``: the arena bytes the keys actually use;
* ``meta_anon_bytes_per_object``: growth of the daemon's private memory (``RssAnon``)
  over the fill, per object — any per-key state the service keeps outside the table;
* ``fill_us_per_object``: put throughput for tiny objects (metadata cost alone);
* ``exists_p50_us`` / ``exists_p99_us``: ``batch_exists`` of 4096 stored keys on the
  full table (random slots, so the lookups miss the CPU caches).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from kvfabric.bench.stores import kvpool

FILL_BATCH = 4096
ALIGN = 256  # the pool's default allocation granularity


def _rss(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("RssAnon:", "RssShmem:")):
                    name, value, _unit = line.split()
                    out[name.rstrip(":")] = int(value) * 1024
    except OSError:
        pass
    return out


def _key(i: int) -> str:
    return f"dsr1/tp0/{i:024x}"  # 33 bytes, the shape of a hashed block key


def measure(objects: int, fill: int, workdir: str) -> dict[str, Any]:
    from kvfabric.pool import connect
    from kvfabric.pool.table import HDR_BYTES, SLOT

    fill = min(fill, objects)
    svc = kvpool.start(fill * ALIGN * 5 // 4 + (64 << 20), workdir, {"max_objects": objects})
    try:
        client = connect(svc.socket, timeout=60.0)
        tiny = np.zeros(4096, np.uint8)
        buf = client.platform.wrap(tiny)
        try:
            rss0 = _rss(svc.proc.pid)
            failed = 0
            t0 = time.perf_counter()
            for start in range(0, fill, FILL_BATCH):
                n = min(FILL_BATCH, fill - start)
                keys = [_key(i) for i in range(start, start + n)]
                st = client.batch_put_from(
                    keys, np.full(n, tiny.ctypes.data, np.uint64), np.ones(n, np.uint64)
                )
                failed += int(np.count_nonzero(st))
            fill_s = time.perf_counter() - t0
            rss1 = _rss(svc.proc.pid)
            table = client.table
            if table is None:
                raise RuntimeError("the pool client did not map the directory table")
            arena = int(table.hdr["arena_size"][0])
            seg_bytes = HDR_BYTES + table.nslots * SLOT.itemsize + arena
            rng = np.random.default_rng(0)
            probe = [_key(int(i)) for i in rng.choice(fill, size=min(4096, fill), replace=False)]
            times, hits = [], 0
            for _ in range(20):
                t = time.perf_counter()
                hits = int(client.batch_exists(probe).sum())
                times.append(time.perf_counter() - t)
            return {
                "objects": objects,
                "filled": fill - failed,
                "failed": failed,
                "method": "through the pool daemon: batch_put_from of 4096 one-byte objects per call",
                "bytes_per_object": round((seg_bytes - arena) / objects, 1),
                "bytes_per_object_with_keys": round(seg_bytes / objects, 1),
                "key_bytes_per_object": round(int(table.hdr["arena_used"][0]) / max(1, fill - failed), 1),
                "table_bytes": seg_bytes,
                "table_slots": table.nslots,
                "arena_bytes": arena,
                "meta_anon_bytes_per_object": round(
                    (rss1.get("RssAnon", 0) - rss0.get("RssAnon", 0)) / max(1, fill), 1
                ),
                "fill_us_per_object": round(fill_s / max(1, fill) * 1e6, 2),
                "exists_keys": len(probe),
                "exists_hits": hits,
                "exists_p50_us": round(statistics.median(times[2:]) * 1e6, 1),
                "exists_p99_us": round(float(np.percentile(times[2:], 99)) * 1e6, 1),
            }
        finally:
            client.platform.free(buf)
            client.close()
    finally:
        svc.stop()
