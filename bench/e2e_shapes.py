"""``kvfabric bench e2e``'s ``shape`` rows: the deployment shapes of the connector on the
CPU build of vLLM, each TTFT cold (a prompt the store has never seen) next to warm (a
prompt stored once), medians over the rounds, hit tokens from vLLM's ``num_cached_tokens``:

- ``multiprocess``: SmolLM2 with vLLM's default multiprocessing (the engine core, so
  scheduler and worker connectors, in a process of its own) and no ``pool_address``: the
  node's pool daemon, auto-started;
- ``tp2``: the tiny random Llama (SmolLM2's 9 heads do not split over two ranks) with two
  tensor-parallel worker processes (``mp`` executor) on the auto-started daemon;
- ``pd``: a producer engine (``kv_producer``) prefills and hands ``kv_transfer_params`` to
  a consumer engine (``kv_consumer``) in another process, on one pool daemon; cold is the
  consumer computing a prompt itself, warm the consumer given the hand-off.

``shape_rows(ctx, rounds)`` yields them (``bench/e2e.py`` runs it after its ``ttft``
rows); every engine is closed before the next starts, and the daemons' sockets live
under a temporary ``XDG_RUNTIME_DIR`` for the run.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from kvfabric.bench.report import BenchContext

SHAPE_TOKENS = 2048


def _first_token(
    llm: Any, prompt: list[int], transfer_params: dict[str, Any] | None = None
) -> tuple[float, Any]:
    """Seconds to the first token of one request (its ``kv_transfer_params``:
    ``transfer_params``), and vLLM's output of it."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    if transfer_params is not None:
        sp.extra_args = {"kv_transfer_params": transfer_params}
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
    return time.perf_counter() - t0, out


def _ttft_of(llm: Any, prompt: list[int], transfer_params: dict[str, Any] | None = None) -> tuple[float, int]:
    """Seconds to the first token of one request, and the prompt tokens it did not compute."""
    secs, out = _first_token(llm, prompt, transfer_params)
    return secs, int(out.num_cached_tokens or 0)


def _shape_row(
    shape: str, model: str, cold: list[float], warm: list[float], hits: list[int]
) -> dict[str, Any]:
    c, w = statistics.median(cold), statistics.median(warm)
    return {
        "case": "shape",
        "shape": shape,
        "model": model,
        "prompt_tokens": SHAPE_TOKENS,
        "ttft_cold_s": round(c, 4),
        "ttft_warm_s": round(w, 4),
        "ratio_cold_over_warm": round(c / w, 2),
        "hit_tokens": min(hits) if hits else 0,
        "rounds": len(warm),
    }


def shape_rows(ctx: BenchContext, rounds: int) -> Iterator[dict[str, Any]]:
    import os

    from kvfabric.harness.engine import make_engine, pool_transfer_config
    from kvfabric.harness.models import smollm2, tiny_llama

    rounds = min(rounds, 3) if ctx.quick else rounds
    tmp = tempfile.mkdtemp(prefix="kvf-bench-shapes-")
    old_runtime = os.environ.get("XDG_RUNTIME_DIR")
    os.environ["XDG_RUNTIME_DIR"] = tmp  # the auto-started daemons' sockets live here
    rng = np.random.default_rng(11)

    def prompt(vocab: int) -> list[int]:
        return rng.integers(3, vocab, SHAPE_TOKENS).tolist()

    def pool(name: str, role: str = "kv_both", auto: bool = False) -> dict[str, Any]:
        extra: dict[str, Any] = {"pool_address": "auto"} if auto else {}
        cfg = pool_transfer_config(name, "256MiB", "1GiB", **extra)
        return {**cfg, "kv_role": role}

    def cold_warm(llm: Any, vocab: int) -> tuple[list[float], list[float], list[int]]:
        cold, warm, hits = [], [], []
        _ttft_of(llm, prompt(vocab))  # warm-up: the first request pays one-time costs
        for _ in range(rounds):
            cold.append(_ttft_of(llm, prompt(vocab))[0])
        stored = prompt(vocab)
        _ttft_of(llm, stored)
        time.sleep(0.5)  # the dumps of the last request land in the pool
        _ttft_of(llm, stored)  # unmeasured: the load path's pages fault in once
        for _ in range(rounds):
            t, h = _ttft_of(llm, stored)
            warm.append(t)
            hits.append(h)
        return cold, warm, hits

    try:
        model = str(smollm2())
        eng = make_engine(model, pool("bench-mp"), kv_bytes=512 << 20, in_process=False)
        try:
            yield _shape_row("multiprocess", "SmolLM2-135M-Instruct", *cold_warm(eng.llm, 40000))
        finally:
            eng.close()
        eng = make_engine(str(tiny_llama()), pool("bench-tp2"), kv_bytes=256 << 20, tensor_parallel_size=2)
        try:
            yield _shape_row("tp2", "tiny-llama (random, 4 layers)", *cold_warm(eng.llm, 512))
        finally:
            eng.close()
        yield from _pd_rows(model, pool, prompt, rounds)
    finally:
        if old_runtime is None:
            os.environ.pop("XDG_RUNTIME_DIR", None)
        else:
            os.environ["XDG_RUNTIME_DIR"] = old_runtime
        shutil.rmtree(tmp, ignore_errors=True)


def _pd_rows(
    model: str, pool: Callable[..., dict[str, Any]], prompt: Callable[[int], list[int]], rounds: int
) -> Iterator[dict[str, Any]]:
    from kvfabric.harness.engine import BLOCK_SIZE, make_engine

    producer = make_engine(model, pool("bench-pd", "kv_producer"), kv_bytes=512 << 20, in_process=False)
    consumer = None
    try:  # the consumer in this process: vLLM reports a P/D request's cached tokens as the
        # producer's, so the consumer's loads are read from its worker's counters
        consumer = make_engine(model, pool("bench-pd", "kv_consumer", auto=True), kv_bytes=512 << 20)
        _ttft_of(consumer.llm, prompt(40000))
        _ttft_of(producer.llm, prompt(40000))
        cold, warm, hits, prefill = [], [], [], []
        for i in range(rounds + 1):
            cold_t, _ = _ttft_of(consumer.llm, prompt(40000))
            p = prompt(40000)
            prefill_t, out = _first_token(producer.llm, p, {"do_remote_decode": True})
            handoff = out.kv_transfer_params
            w = consumer.worker()
            before = w.stats.totals.get("loaded_blocks", 0) if w is not None else 0
            warm_t, _ = _ttft_of(consumer.llm, p, handoff)
            hit = (w.stats.totals.get("loaded_blocks", 0) - before) * BLOCK_SIZE if w is not None else 0
            if i:  # the first round faults the consumer's load path in
                cold.append(cold_t)
                warm.append(warm_t)
                hits.append(hit)
                prefill.append(prefill_t)
        row = _shape_row("pd", "SmolLM2-135M-Instruct", cold, warm, hits)
        row["producer_prefill_s"] = round(statistics.median(prefill), 4)
        yield row
    finally:
        producer.close()
        if consumer is not None:
            consumer.close()
