"""``kvfabric bench e2e``: time to first token through kvfabric on a real vLLM, and the Delegator.

Four kinds of rows, measured in one run:

* ``gather`` rows: the Delegator's gather of 64 blocks (one batched copy) next to one
  copy call per piece (what a connector pays that hands a store every piece on its own).
* ``delegator`` rows: dumps of 64 blocks of a paged KV cache (several layouts: the CPU
  backend's 48 KiB whole-block pages of SmolLM2, a K/V-split layout, many 4 KiB pieces)
  into a store, with the Delegator on (gather into staging slots, one piece per block)
  and off (the store gets every piece), rounds interleaved on/off; medians; GB/s of KV
  bytes stored (wall) and the sim platform's modelled device copy time of each.
* ``ttft`` rows: SmolLM2-135M-Instruct on the CPU build of vLLM (float32, 32-token
  blocks, vLLM's prefix cache off), prompts of 512, 2,048 and 7,000 tokens (``--quick``:
  512 and 2,048) that are prefixes of one token sequence. Time to first token cold (no
  connector), warm through kvfabric (the prompt was stored once, each round loads it),
  and warm through vLLM's own ``ExampleConnector`` (safetensors files), each a median of
  the rounds; ``ratio_cold_over_warm`` and ``ratio_example_over_kvfabric``. One engine
  per mode, one after the other in this process; before measuring, each engine serves a
  warm-up request and the prompt twice (storing it, and faulting in the pages of the
  load path once), as a long-running server would have.

kvfabric's store is the connector's default, ``cache|pool`` (a pool embedded in the engine
process); ``ExampleConnector`` writes its files under a temporary directory.

* ``shape`` rows: the deployment shapes (multiprocess, TP=2, P/D), TTFT cold next to
  warm; measured by ``bench/e2e_shapes.py`` (see there).
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from kvfabric.bench.e2e_shapes import shape_rows
from kvfabric.bench.report import BenchContext, cpu_busy_fraction, machine_note, read_cpu_row
from kvfabric.status import ItemStatus

KiB = 1 << 10
FULL_LENGTHS = (512, 2048, 7000)
QUICK_LENGTHS = (512, 2048)
# (name, layers, K/V split, bytes per piece)
LAYOUTS = (
    ("smollm2-cpu-pages", 30, False, 48 * KiB),
    ("kv-split-60x24KiB", 30, True, 24 * KiB),
    ("many-small-122x4KiB", 61, True, 4 * KiB),
)
DUMP_BLOCKS = 64


def _median_interleaved(fns: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    out: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():  # warm-up round (first touch, code paths)
        f()
    for _ in range(rounds):
        for k, f in fns.items():
            out[k].append(f())
    return {k: statistics.median(v) for k, v in out.items()}


def _gather_row(plat: Any, lay: Any, name: str, rounds: int) -> dict[str, Any]:
    """The Delegator's gather (one batched copy) next to a copy call per piece, the path
    of a connector that hands a store each piece as its own transfer."""
    from kvfabric.platform.types import CopyBatch, Medium

    blocks = np.arange(DUMP_BLOCKS)
    src = lay.addrs(blocks)
    dst = plat.alloc(DUMP_BLOCKS * lay.block_bytes, Medium.HBM)
    dst.numpy()[:] = 0
    off = np.concatenate([[0], np.cumsum(lay.size)[:-1]]).astype(np.uint64)
    staged = (
        np.uint64(dst.ptr) + blocks.astype(np.uint64)[:, None] * np.uint64(lay.block_bytes) + off[None, :]
    )
    sizes = np.broadcast_to(lay.size[None, :], src.shape).reshape(-1)
    batch = CopyBatch(staged.reshape(-1), src.reshape(-1), sizes)
    pairs = [
        (plat.find(int(d), int(n)), plat.find(int(s_), int(n)), int(n))
        for d, s_, n in zip(batch.dst, batch.src, batch.nbytes)
    ]

    def batched() -> float:
        t0 = time.perf_counter()
        plat.batch_copy(batch)
        return time.perf_counter() - t0

    def per_piece() -> float:
        t0 = time.perf_counter()
        for d, s_, n in pairs:
            plat.copy(d, s_, n)
        return time.perf_counter() - t0

    med = _median_interleaved({"batched": batched, "per_piece": per_piece}, rounds)
    plat.free(dst)
    return {**_pair_row("gather", name, lay, med, "batched", "per_piece"), "rounds": rounds}


def _pair_row(
    case: str, name: str, lay: Any, med: dict[str, float], a: str, b: str, **extra: Any
) -> dict[str, Any]:
    """The figures of ``DUMP_BLOCKS`` blocks of layout ``lay`` moved two ways (median
    seconds ``med[a]``, ``med[b]``): GB/s of each and how many times faster ``a`` is."""
    nbytes = DUMP_BLOCKS * lay.block_bytes
    return {
        "case": case,
        "layout": name,
        "pieces_per_block": lay.pieces,
        **extra,
        "nbytes": nbytes,
        f"{a}_gbps": round(nbytes / med[a] / 1e9, 3),
        f"{b}_gbps": round(nbytes / med[b] / 1e9, 3),
        f"ratio_{a}_over_{b}": round(med[b] / med[a], 3),
    }


def _delegator_rows(ctx: BenchContext, rounds: int) -> Iterator[dict[str, Any]]:
    import torch

    from kvfabric.platform.registry import create
    from kvfabric.platform.types import Medium
    from kvfabric.ucm_layer.connector.config import default_store
    from kvfabric.ucm_layer.delegator import Delegator
    from kvfabric.ucm_layer.kv_layout import layout_from_tensors
    from kvfabric.ucm_layer.store import registry

    plat = create("sim")
    nb = DUMP_BLOCKS * 2
    stores = [default_store(), "posix"] if not ctx.quick else [default_store()]
    try:
        for name, layers, kv, piece in LAYOUTS:
            el = piece // 4
            caches = {f"l{i}": torch.randn(2, nb, el) if kv else torch.randn(nb, el) for i in range(layers)}
            for t in caches.values():
                plat.wrap(t, Medium.HBM)
            lay = layout_from_tensors(caches, nb)
            yield _gather_row(plat, lay, name, rounds)
            for spec in stores:
                tmp = tempfile.mkdtemp(prefix="kvf-bench-")
                built = {}
                try:
                    for on in (True, False):
                        cfg: dict[str, Any] = {"store": spec}
                        if "posix" in spec:
                            cfg["posix.dirs"] = f"{tmp}/{int(on)}"
                        if "cache" in spec:
                            cfg["cache.capacity"] = (rounds + 2) * DUMP_BLOCKS * lay.block_bytes
                        st = registry.create(
                            config=cfg, platform=plat, layout=Delegator.store_layout(lay, on, False)
                        )
                        built[on] = (st, Delegator(plat, lay, st, enabled=on, staging_blocks=DUMP_BLOCKS))
                    rng = np.random.default_rng(0)
                    sim: dict[bool, list[float]] = {True: [], False: []}

                    def dump(on: bool, rng: Any = rng, built: Any = built, sim: Any = sim) -> float:
                        ids = rng.integers(0, 256, (DUMP_BLOCKS, 16), dtype=np.uint8)
                        before = sum(r.sim_s for r in plat.ledger.totals())
                        t0 = time.perf_counter()
                        status = built[on][1].dump(ids, np.arange(DUMP_BLOCKS)).wait()
                        dt = time.perf_counter() - t0
                        sim[on].append(sum(r.sim_s for r in plat.ledger.totals()) - before)
                        if (status != ItemStatus.OK).any():
                            raise RuntimeError(f"bench dump failed: {status}")
                        return dt

                    med = _median_interleaved({"on": lambda: dump(True), "off": lambda: dump(False)}, rounds)
                    yield {
                        **_pair_row("delegator", name, lay, med, "on", "off", store=spec),
                        "sim_copy_ms_on": round(statistics.median(sim[True]) * 1e3, 3),
                        "sim_copy_ms_off": round(statistics.median(sim[False]) * 1e3, 3),
                        "rounds": rounds,
                    }
                finally:
                    for st, d in built.values():
                        d.close()
                        st.close()
                    shutil.rmtree(tmp, ignore_errors=True)
            for buf in plat.buffers():
                plat.free(buf)
    finally:
        plat.close()


def _ttft_rows(ctx: BenchContext, rounds: int) -> Iterator[dict[str, Any]]:
    from kvfabric.harness.engine import example_transfer_config, kvfabric_transfer_config, make_engine
    from kvfabric.harness.models import smollm2
    from kvfabric.ucm_layer.connector.config import default_store

    model = smollm2()
    lengths = QUICK_LENGTHS if ctx.quick else FULL_LENGTHS
    base = np.random.default_rng(7).integers(100, 40000, max(lengths)).tolist()
    prompts = {n: base[:n] for n in lengths}
    warmup = np.random.default_rng(8).integers(100, 40000, 64).tolist()
    kv_bytes = 512 << 20
    store = default_store()
    tmp = tempfile.mkdtemp(prefix="kvf-bench-e2e-")
    samples: dict[str, dict[int, list[float]]] = {
        m: {n: [] for n in lengths} for m in ("cold", "kvfabric", "example")
    }
    loaded: dict[int, int] = dict.fromkeys(lengths, 0)
    modes = {
        "cold": None,
        "kvfabric": kvfabric_transfer_config(store, f"{tmp}/kvfabric", cache_bytes="1GiB", pool_bytes="1GiB"),
        "example": example_transfer_config(f"{tmp}/example"),
    }
    try:
        for mode, transfer in modes.items():
            eng = make_engine(model, transfer, kv_bytes=kv_bytes, max_model_len=8192)
            try:
                eng.ttft(warmup)  # the first request after start pays one-time costs
                for n, p in prompts.items():
                    eng.ttft(p)  # connectors: store the prompt; every mode: touch the pages
                    eng.flush()
                    eng.ttft(p)  # unmeasured: the load path's buffers fault in once
                    w = eng.worker() if mode == "kvfabric" else None
                    before = w.stats.totals["loaded_blocks"] if w is not None else 0
                    samples[mode][n] = [eng.ttft(p) for _ in range(rounds)]
                    if w is not None:
                        loaded[n] = (w.stats.totals["loaded_blocks"] - before) // rounds
            finally:
                eng.close()
        results = {m: {n: statistics.median(v) for n, v in d.items()} for m, d in samples.items()}
        for n in lengths:
            cold, warm, ex = results["cold"][n], results["kvfabric"][n], results["example"][n]
            yield {
                "case": "ttft",
                "model": "SmolLM2-135M-Instruct",
                "prompt_tokens": n,
                "store": store,
                "ttft_cold_s": round(cold, 4),
                "ttft_kvfabric_s": round(warm, 4),
                "ttft_example_s": round(ex, 4),
                "ratio_cold_over_warm": round(cold / warm, 2),
                "ratio_example_over_kvfabric": round(ex / warm, 2),
                "loaded_blocks": loaded[n],
                "rounds": rounds,
            }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(ctx: BenchContext) -> Iterator[dict[str, Any]]:
    rounds = max(ctx.rounds, 5)
    note = machine_note()
    a = read_cpu_row()
    rows = list(_delegator_rows(ctx, rounds))
    from kvfabric.harness.engine import vllm_problem

    problem = vllm_problem()
    if problem:
        raise ImportError(f"kvfabric bench e2e needs vLLM: {problem}")
    rows += list(_ttft_rows(ctx, rounds))
    rows += list(shape_rows(ctx, rounds))
    busy = cpu_busy_fraction((a, read_cpu_row()))
    for r in rows:
        r.update(note)
        r["cpu_busy"] = round(busy, 2)
        yield r
