"""``kvfabric bench store``: stores and pipelines next to memcpy, plain file I/O and vLLM.

Cases, every figure next to its comparison measured in the same run (rounds interleaved,
medians of at least 5 rounds, every buffer pre-touched):

* dump / load of ``blocks`` blocks (128; 32 with ``--quick``) for each store and pipeline,
  in three block shapes: ``2x28x64KiB`` (2 x 28 layers of 64 KiB, one piece per layer
  tensor, as vLLM lays KV caches out; 3.5 MiB), ``deepseek-r1`` (61 layers x (128 KiB
  latent + 16 KiB rope) = 122 pieces, 8.6 MiB) and ``2x28x8KiB`` (448 KiB, below 1 MiB).
  The caller's buffers are device memory (``HBM``) of the platform; ``ratio_vs_memcpy``
  divides by a numpy copy of the same number of bytes between two pre-touched host
  arrays. Dumps use fresh ids every round (stores are put-if-absent); loads read the
  blocks just dumped (resident in a cache). For ``cache|posix`` also ``load_miss``:
  blocks only in the posix tier.
* checksum verification: every load is measured twice per round, with ``verify`` on (the
  default) and off (``set_verify``), in alternating order; the ``*_noverify`` rows are the
  loads with it off and each verified row carries ``noverify_gbps`` and
  ``ratio_vs_noverify`` (1.0: verification is free; 0.9: it costs 10 % of throughput).
* stores with a posix tier also carry ``read_gbps`` / ``write_gbps``: a ``cp``-style read
  of the same block files into one reused host buffer, and a plain write of the same
  bytes to new files, with ``ratio_vs_read`` (posix loads, pipeline loads of misses) and
  ``ratio_vs_write`` (dumps).
* ``lookup_prefix`` of 1,000 present ids (p50 / p99 over 200 calls).
* block hashing of a 128K-token prompt in tokens/s, from token ids and from vLLM's block
  hashes, next to vLLM's own ``hash_block_tokens`` chain (sha256, its default) when
  vLLM is installed (``ratio_vs_vllm``).

``other_cores_busy`` says how many cores' worth of work other processes did during a
case (0 means the other cores were idle). Block files go to a temporary directory
(``TMPDIR`` picks the file system).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from kvfabric.bench.report import BenchContext, machine_note
from kvfabric.bench.store_io import CpuMeter, LayerBuffers, hashing_rows, plain_read, plain_write
from kvfabric.platform.registry import create
from kvfabric.platform.types import Medium
from kvfabric.ucm_layer.store import registry
from kvfabric.ucm_layer.store.base import BlockStatus, Store, StoreLayout

KiB, MiB = 1 << 10, 1 << 20
SHAPES: dict[str, tuple[int, ...]] = {
    "2x28x64KiB": (64 * KiB,) * 56,
    "deepseek-r1": (128 * KiB, 16 * KiB) * 61,
    "2x28x8KiB": (8 * KiB,) * 56,
}
#: stores and pipelines benchmarked
STORES = ["posix", "cache", "cache|posix", "pool", "cache|pool"]
LOOKUP_IDS = 1000
#: the timed operations reported, each verified load next to the same load unverified
LOAD_OPS = (
    "dump",
    "load",
    "load_noverify",
    "load_miss",
    "load_miss_noverify",
    "load_host",
    "load_host_noverify",
)


def _ids(n: int, rng: np.random.Generator) -> np.ndarray:
    return rng.integers(0, 256, (n, 16), dtype=np.uint8)


def _config(spec: str, root: str, layout: StoreLayout, blocks: int) -> dict[str, Any]:
    cfg: dict[str, Any] = {}
    if "posix" in spec:
        cfg["posix.dirs"] = [root]
    if "cache" in spec:
        cfg["cache.capacity"] = 2 * blocks * (layout.shard_bytes + 64) + MiB
        cfg["cache.prefault"] = True
    if "pool" in spec:  # an embedded pool (pre-touched), with room for a few rounds
        cfg["pool.embedded_dram"] = 3 * blocks * (layout.shard_bytes + 4 * KiB) + 64 * MiB
    return cfg


def _posix_of(store: Store) -> Any:
    for s in (store, getattr(store, "lower", None)):
        if s is not None and s.name == "posix":
            return s
    return None


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _must_ok(st: np.ndarray, what: str) -> None:
    if not (st == BlockStatus.OK).all():
        raise RuntimeError(f"{what}: {int((st != BlockStatus.OK).sum())} block(s) not OK: {np.unique(st)}")


def _both(store: Store, r: int, fn: Callable[[], float]) -> tuple[float, float]:
    """``fn`` (a timed load) with verification on and off, the order alternating by round;
    verification is left on."""
    times: dict[bool, float] = {}
    for on in (True, False) if r % 2 == 0 else (False, True):
        store.set_verify(on)
        times[on] = fn()
    store.set_verify(True)
    return times[True], times[False]


def _store_case(ctx: BenchContext, plat: Any, spec: str, shape: str, blocks: int) -> Iterator[dict[str, Any]]:
    layout = StoreLayout(SHAPES[shape])
    nbytes = blocks * layout.shard_bytes
    rounds = max(ctx.rounds, 5)
    root = tempfile.mkdtemp(prefix="kvf-bench-store-")
    store = registry.create(spec, _config(spec, root, layout, blocks), platform=plat, layout=layout)
    src = LayerBuffers(plat, layout, blocks, seed=1)
    dst = LayerBuffers(plat, layout, blocks, seed=None)
    # a posix store loading into host memory (a CPU engine's KV cache) reads files straight
    # into the pieces: measured too, next to the same plain read
    dst_host = LayerBuffers(plat, layout, blocks, seed=None, medium=Medium.DRAM) if spec == "posix" else None
    base_a = np.ones(nbytes, np.uint8)
    base_b = np.zeros(nbytes, np.uint8)
    posix = _posix_of(store)
    host = np.zeros(layout.shard_bytes, np.uint8) if posix is not None else None
    times: dict[str, list[float]] = {}
    rng = np.random.default_rng(7)
    meter = CpuMeter()
    try:
        for r in range(rounds + 1):  # round 0 warms every path up and checks the bytes
            ids = _ids(blocks, rng)
            t_dump, st = _timed(lambda ids=ids: store.wait(store.dump(ids, 0, src.addrs)))
            _must_ok(st, f"{spec} dump")

            def load(ids: np.ndarray = ids, into: LayerBuffers = dst, what: str = "load") -> float:
                t, st = _timed(lambda: store.wait(store.load(ids, 0, into.addrs)))
                _must_ok(st, f"{spec} {what}")
                return t

            t_load, t_load_nv = _both(store, r, load)
            t_mem, _ = _timed(lambda: np.copyto(base_b, base_a))
            sample = {"dump": t_dump, "load": t_load, "load_noverify": t_load_nv, "memcpy": t_mem}
            if dst_host is not None:
                sample["load_host"], sample["load_host_noverify"] = _both(
                    store, r, lambda: load(into=dst_host, what="load into host memory")
                )
            if r == 0 and not np.array_equal(src.sample(), dst.sample()):
                raise RuntimeError(f"{spec}: loaded bytes differ from dumped ones")
            if spec == "cache|posix":
                cold = {on: _ids(blocks, rng) for on in (True, False)}
                for c in cold.values():
                    _must_ok(store.lower.wait(store.lower.dump(c, 0, src.addrs)), "posix dump")
                sample["load_miss"], sample["load_miss_noverify"] = _both(
                    store, r, lambda cold=cold: load(cold[store.verify.value == "on"], what="load of misses")
                )
            if posix is not None:
                paths = posix.files.paths(ids)
                sample["read"] = _timed(lambda paths=paths: plain_read(paths, host))[0]
                plain = os.path.join(root, "plain")
                sample["write"] = _timed(lambda plain=plain: plain_write(plain, host, blocks))[0]
                shutil.rmtree(plain)  # keep the page cache and the disk bounded
                for p in paths:
                    os.unlink(p)
            if r:
                for k, v in sample.items():
                    times.setdefault(k, []).append(v)
        busy = meter.other_cores_busy()
        med = {k: statistics.median(v) for k, v in times.items()}
        mem_gbps = nbytes / med["memcpy"] / 1e9
        for op in LOAD_OPS:
            if op not in med:
                continue
            gbps = nbytes / med[op] / 1e9
            row: dict[str, Any] = {
                "store": spec,
                "op": op,
                "shape": shape,
                "blocks": blocks,
                "pieces": layout.pieces,
                "nbytes": nbytes,
                "gbps": round(gbps, 3),
                "memcpy_gbps": round(mem_gbps, 3),
                "ratio_vs_memcpy": round(gbps / mem_gbps, 3),
                "p50_us": round(med[op] * 1e6, 1),
                "rounds": rounds,
                "platform": plat.name,
                "other_cores_busy": busy,
            }
            if f"{op}_noverify" in med:
                nv_gbps = nbytes / med[f"{op}_noverify"] / 1e9
                row["noverify_gbps"] = round(nv_gbps, 3)
                row["ratio_vs_noverify"] = round(gbps / nv_gbps, 3)
            # the plain file I/O a store op competes with: a posix store's own loads and
            # dumps; a pipeline's dumps and its loads of blocks only the posix tier has
            ref = {
                "dump": "write",
                "load": "read" if spec == "posix" else None,
                "load_miss": "read",
                "load_host": "read",
            }.get(op.removesuffix("_noverify"))
            if posix is not None and ref is not None:
                ref_gbps = nbytes / med[ref] / 1e9
                row[f"{ref}_gbps"] = round(ref_gbps, 3)
                row[f"ratio_vs_{ref}"] = round(gbps / ref_gbps, 3)
            yield row
    finally:
        store.close()
        src.free()
        dst.free()
        if dst_host is not None:
            dst_host.free()
        shutil.rmtree(root, ignore_errors=True)


def _lookup_case(plat: Any, spec: str) -> dict[str, Any]:
    layout = StoreLayout((4 * KiB,))
    root = tempfile.mkdtemp(prefix="kvf-bench-lookup-")
    store = registry.create(spec, _config(spec, root, layout, LOOKUP_IDS), platform=plat, layout=layout)
    src = LayerBuffers(plat, layout, LOOKUP_IDS, seed=2)
    meter = CpuMeter()
    try:
        ids = _ids(LOOKUP_IDS, np.random.default_rng(3))
        _must_ok(store.wait(store.dump(ids, 0, src.addrs)), f"{spec} dump")
        if store.lookup_prefix(ids) != LOOKUP_IDS:
            raise RuntimeError(f"{spec}: lookup_prefix does not see the {LOOKUP_IDS} blocks just dumped")
        lat = []
        for _ in range(200):
            t, _ = _timed(lambda: store.lookup_prefix(ids))
            lat.append(t)
        lat.sort()
        return {
            "store": spec,
            "op": "lookup_prefix",
            "blocks": LOOKUP_IDS,
            "p50_us": round(lat[len(lat) // 2] * 1e6, 1),
            "p99_us": round(lat[int(len(lat) * 0.99)] * 1e6, 1),
            "target_us": 2000,
            "platform": plat.name,
            "other_cores_busy": meter.other_cores_busy(),
        }
    finally:
        store.close()
        src.free()
        shutil.rmtree(root, ignore_errors=True)


def run(ctx: BenchContext) -> Iterator[dict[str, Any]]:
    blocks = 32 if ctx.quick else 128
    note = machine_note()
    for row in hashing_rows(ctx):
        yield {**row, **note}
    plat = create(ctx.platform)
    try:
        for spec in STORES:
            yield {**_lookup_case(plat, spec), **note}
        for shape in SHAPES:
            for spec in STORES:
                for row in _store_case(ctx, plat, spec, shape, blocks):
                    yield {**row, **note}
    finally:
        plat.close()
