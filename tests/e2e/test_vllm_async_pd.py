"""Asynchronous loads and disaggregated prefill (P/D) through the pool, on the CPU vLLM.

Async loads: a batch of four requests where one loads a 2,048-token prefix from the
store. The store's reads are held back (a real posix store whose file reads wait on a
gate) until the other three have produced tokens: the loading request waits in vLLM
(``WAITING_FOR_REMOTE_KVS``) while the others keep decoding, which the test observes
step by step; released, the load completes and the request's tokens are the cold run's.

P/D: a producer engine (``kv_producer``, its engine core in a process of its own) and a
consumer engine (``kv_consumer``, in this process, so its connector's counters can be
read) share the node's pool daemon. The producer prefills (one token, as a P/D proxy
asks) and hands back ``kv_transfer_params``; the consumer, given them, loads every full
block the producer stored and its tokens are those of an engine without kvfabric. (vLLM
reports a P/D request's ``num_cached_tokens`` as the producer's own cache hits, so the
consumer's loads are read from its worker's counters.)
"""

from __future__ import annotations

import numpy as np
import pytest
from daemon_exit import wait_gone
from kvf_testing import segments
from store_faults import SlowReadIO

from kvfabric.harness.engine import BLOCK_SIZE, kvfabric_transfer_config, make_engine
from kvfabric.pool.autostart import daemon_pid


def _tokens(n: int, seed: int, vocab: int = 512) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, n).tolist()


def _params(max_tokens: int, transfer: dict | None = None):
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    if transfer is not None:
        sp.extra_args = {"kv_transfer_params": transfer}
    return sp


def test_requests_keep_decoding_while_another_loads_its_prefix(tiny_model, tmp_path):
    long_prompt = _tokens(2048, 1)
    others = {f"o{i}": _tokens(96, 10 + i) for i in range(3)}
    eng = make_engine(
        tiny_model, kvfabric_transfer_config("posix", tmp_path), kv_bytes=96 << 20, max_model_len=4096
    )
    try:
        (cold,) = eng.generate([long_prompt], 8)
        eng.flush()
        worker = eng.worker()
        assert worker.cfg.async_load  # the default
        gate = SlowReadIO()
        worker.store.io = gate  # the store's reads wait until the gate opens

        engine = eng.llm.llm_engine
        engine.add_request("loader", {"prompt_token_ids": long_prompt}, _params(8))
        for rid, p in others.items():
            engine.add_request(rid, {"prompt_token_ids": p}, _params(24))
        produced = dict.fromkeys(others, 0)
        during: dict[str, int] = {}
        finished: dict[str, object] = {}
        for _ in range(2000):
            for out in engine.step():
                if out.request_id in produced:
                    produced[out.request_id] = len(out.outputs[0].token_ids)
                if out.finished:
                    finished[out.request_id] = out
            if not gate.release.is_set() and gate.started.is_set() and min(produced.values()) >= 4:
                # the load is held in the store: the others decoded meanwhile, the loader did not
                assert "loader" not in finished
                during = dict(produced)
                gate.release.set()
            if len(finished) == 4:
                break
        assert during and min(during.values()) >= 4, "the other requests did not decode during the load"
        loader = finished["loader"]
        assert list(loader.outputs[0].token_ids) == cold  # loaded, not recomputed: same tokens
        assert loader.num_cached_tokens == (len(long_prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
        totals = worker.stats.totals
        assert totals.get("load_failed_blocks", 0) == 0
    finally:
        eng.close()


@pytest.fixture
def runtime(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))  # the auto-started daemon's socket
    return tmp_path


def test_pd_through_the_pool_daemon_consumer_loads_every_full_block(tiny_model, runtime, isolated_shm):
    prompt = _tokens(600, 7)
    full = (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
    ref_engine = make_engine(tiny_model, None, kv_bytes=64 << 20)
    try:
        ref = ref_engine.llm.generate([{"prompt_token_ids": prompt}], _params(12), use_tqdm=False)[0]
        ref_tokens = list(ref.outputs[0].token_ids)
    finally:
        ref_engine.close()

    pool = "e2e-pd"

    def transfer(role: str) -> dict:
        cfg = kvfabric_transfer_config(
            "cache|pool",
            cache_bytes="32MiB",
            pool_bytes="128MiB",
            pool_address="auto",
            pool_idle_exit_s=2,
            store_options={"pool.name": pool},
        )
        return {**cfg, "kv_role": role}

    producer = make_engine(tiny_model, transfer("kv_producer"), kv_bytes=64 << 20, in_process=False)
    consumer = None
    try:
        consumer = make_engine(tiny_model, transfer("kv_consumer"), kv_bytes=64 << 20)
        pre = producer.llm.generate(
            [{"prompt_token_ids": prompt}], _params(1, {"do_remote_decode": True}), use_tqdm=False
        )[0]
        handoff = pre.kv_transfer_params
        assert handoff and handoff["do_remote_prefill"] is True
        assert handoff["kvfabric"]["blocks"] == full // BLOCK_SIZE
        assert list(pre.outputs[0].token_ids) == ref_tokens[:1]
        out = consumer.llm.generate([{"prompt_token_ids": prompt}], _params(12, handoff), use_tqdm=False)[0]
        totals = consumer.worker().stats.totals
        assert totals["loaded_blocks"] == full // BLOCK_SIZE  # every full block came from the producer
        assert totals.get("load_failed_blocks", 0) == 0 and totals.get("saved_blocks", 0) == 0
        assert list(out.outputs[0].token_ids) == ref_tokens
    finally:
        sock = str(runtime / f"kvfabric-pool-{pool}.sock")
        pid = daemon_pid(sock)
        producer.close()
        if consumer is not None:
            consumer.close()
    if pid is not None:
        wait_gone(pid, sock, timeout=60)
    assert segments(isolated_shm) == []
