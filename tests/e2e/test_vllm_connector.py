"""kvfabric's connector inside a real vLLM engine (CPU build), greedy sampling.

The scenarios: the same prompt twice with vLLM's own prefix cache off (the second run
loads its prefix through kvfabric and generates the same tokens); blocks stored with the
Delegator on loading with it off (two engine processes sharing one pool daemon are in
test_vllm_pool.py); a store whose
data went bad between runs (recompute, same tokens, one warning when loads fail and one
when they work again); same-size noise over every block's bytes between runs (the
checksums catch it: the blocks fail as ``CORRUPT``, are counted, and the tokens are the
cold run's; the recomputed blocks are stored again and load in the next run); and
a negative control (the same noise with verification off changes the tokens, so the
loads are real and the noise would matter).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest

from kvfabric.harness.engine import BLOCK_SIZE, kvfabric_transfer_config, make_engine
from kvfabric.ucm_layer.connector import metrics
from kvfabric.ucm_layer.store.base import BlockStatus

PROMPT_LEN = 300  # 9 full blocks can load; the 10th holds the last prompt token


def _prompt(seed: int, vocab: int, n: int = PROMPT_LEN) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, n).tolist()


def _block_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".") and "tmp" not in p.name]


def _noise_payloads(engine, root: Path, seed: int) -> int:
    """Overwrite the block bytes of every block file under ``root`` with same-size noise
    (KV-like float32 values), leaving whatever the store keeps after them (its checksum
    trailer) and the file's size as they were. Returns the number of files."""
    layout = engine.worker().store.layout
    payload = layout.num_shards * layout.shard_bytes
    rng = np.random.default_rng(seed)
    files = _block_files(root)
    for f in files:
        size = f.stat().st_size
        assert size >= payload, (f, size, payload)
        noise = (rng.standard_normal(payload // 4) * 3).astype(np.float32).tobytes()
        with open(f, "r+b") as fh:
            assert os.pwrite(fh.fileno(), noise, 0) == payload
        assert f.stat().st_size == size
    return len(files)


def _totals(engine):
    w = engine.worker()
    sched = next(c.scheduler for c in engine.connectors() if c.scheduler is not None)
    return w.stats.totals, sched.stats.totals


@pytest.mark.parametrize(
    "extra",
    [{}, {"layerwise": True}, {"delegator": True}],
    ids=["whole-auto-direct", "layerwise", "delegator"],
)
def test_same_prompt_twice_loads_through_kvfabric(tiny_model, tmp_path, extra):
    eng = make_engine(
        tiny_model,
        kvfabric_transfer_config("cache|posix", tmp_path, cache_bytes="64MiB", **extra),
        kv_bytes=64 << 20,
    )
    try:
        prompt = _prompt(1, 512)
        first = eng.generate([prompt], 12)
        eng.flush()
        worker, sched = _totals(eng)
        assert worker["loaded_blocks"] == 0 and worker["saved_blocks"] >= (PROMPT_LEN - 1) // BLOCK_SIZE
        w = eng.worker()  # the ids cover the physical layout the worker really got
        assert w.expected_layout is not None and w.expected_layout == w.layout.signature
        second = eng.generate([prompt], 12)
        worker, sched = _totals(eng)
        assert second == first
        assert worker["loaded_blocks"] == (PROMPT_LEN - 1) // BLOCK_SIZE
        assert sched["external_hit_tokens"] == (PROMPT_LEN - 1) // BLOCK_SIZE * BLOCK_SIZE
        assert worker["load_failed_blocks"] == 0
    finally:
        eng.close()


def test_blocks_stored_with_the_delegator_on_load_with_it_off(tiny_model, tmp_path):
    """The Delegator switch is not in the block ids and does not change the stored bytes:
    an engine with it off loads (and generates the same tokens from) what one with it on
    stored."""
    prompt = _prompt(5, 512)
    on = make_engine(
        tiny_model, kvfabric_transfer_config("posix", tmp_path, delegator=True), kv_bytes=64 << 20
    )
    try:
        ref = on.generate([prompt], 12)
        on.flush()
        assert on.worker().delegator.enabled
    finally:
        on.close()
    off = make_engine(
        tiny_model, kvfabric_transfer_config("posix", tmp_path, delegator=False), kv_bytes=64 << 20
    )
    try:
        got = off.generate([prompt], 12)
        worker, _ = _totals(off)
        assert not off.worker().delegator.enabled
        assert got == ref
        assert worker["loaded_blocks"] == (PROMPT_LEN - 1) // BLOCK_SIZE
        assert worker["load_failed_blocks"] == 0
    finally:
        off.close()


def test_smollm2_same_prompt_twice(smol_model, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smol_model)
    text = "The history of the printing press begins in the fifteenth century. " * 12
    prompt = tok(text)["input_ids"]
    eng = make_engine(
        smol_model,
        kvfabric_transfer_config("cache|posix", tmp_path, cache_bytes="256MiB"),
        kv_bytes=256 << 20,
        max_model_len=2048,
    )
    try:
        first = eng.generate([prompt], 16)
        eng.flush()
        second = eng.generate([prompt], 16)
        worker, _ = _totals(eng)
        assert second == first
        assert worker["loaded_blocks"] == (len(prompt) - 1) // BLOCK_SIZE > 0
        assert tok.decode(first[0]).strip()  # real text, not an empty completion
    finally:
        eng.close()


def test_store_gone_bad_between_runs_recomputes_with_one_warning(tiny_model, tmp_path, caplog):
    eng = make_engine(tiny_model, kvfabric_transfer_config("posix", tmp_path), kv_bytes=64 << 20)
    try:
        prompt = _prompt(3, 512)
        ref = eng.generate([prompt], 12)
        eng.flush()
        files = _block_files(tmp_path)
        assert files
        for f in files:  # the backing store lost its data: names still there, bytes gone
            f.write_bytes(b"")
        with caplog.at_level(logging.WARNING):
            again = [eng.generate([prompt], 12) for _ in range(2)]
        worker, _ = _totals(eng)
        assert again == [ref, ref]
        # the first rerun fails every block; the store drops the bad files and the
        # connector stores the recomputed blocks again, so the second one loads them all
        assert worker["load_failed_blocks"] == (PROMPT_LEN - 1) // BLOCK_SIZE
        assert worker["loaded_blocks"] == (PROMPT_LEN - 1) // BLOCK_SIZE
        ours = [r for r in caplog.records if r.name == "kvfabric.connector" and r.levelno >= logging.WARNING]
        assert len(ours) == 2, [r.getMessage() for r in ours]  # one when loads fail, one when they work
        assert "recomputes" in ours[0].getMessage() and "succeed again" in ours[1].getMessage()
        assert not [r for r in caplog.records if r.name.startswith("kvfabric") and r.exc_info]
    finally:
        eng.close()


def test_same_size_noise_in_the_store_is_recomputed_not_served(tiny_model, tmp_path):
    """Run 1 (cold) stores the prompt's blocks; same-size noise then replaces every block's
    bytes (the prompt and the noise of the negative control below, where they change the
    tokens); run 2 must give run 1's tokens, every block failing its checksum (counted as
    such, handed to vLLM to recompute) instead of loading; the store dropped the bad
    copies and the connector stored the recomputed blocks again, so run 3 loads them and
    still gives the same tokens."""
    prompt = _prompt(4, 512)
    blocks = (len(prompt) - 1) // BLOCK_SIZE
    eng = make_engine(tiny_model, kvfabric_transfer_config("posix", tmp_path), kv_bytes=64 << 20)
    try:
        cold = eng.generate([prompt], 12)
        eng.flush()
        assert _noise_payloads(eng, tmp_path, seed=0) == blocks > 0
        again = eng.generate([prompt], 12)
        worker, sched = _totals(eng)
        assert again == cold
        assert sched["external_hit_tokens"] == blocks * BLOCK_SIZE  # the lookup saw them: a real try
        assert worker["loaded_blocks"] == 0
        assert worker["load_failed_blocks"] == blocks
        checksum = metrics.failure_counter(metrics.failure_reason(BlockStatus.CORRUPT))
        assert worker[checksum] == blocks
        assert eng.generate([prompt], 12) == cold
        assert _totals(eng)[0]["loaded_blocks"] == blocks
    finally:
        eng.close()


def test_noise_in_the_store_changes_the_tokens_without_verification(tiny_model, tmp_path):
    """Negative control: with the store's checksum check off, the same noise loads as a
    hit and changes the tokens (so the loads are real, and the check above is what keeps
    them right)."""
    transfer = kvfabric_transfer_config("posix", tmp_path, store_options={"posix.verify": "off"})
    eng = make_engine(tiny_model, transfer, kv_bytes=64 << 20)
    try:
        prompt = _prompt(4, 512)
        ref = eng.generate([prompt], 12)
        eng.flush()
        assert _noise_payloads(eng, tmp_path, seed=0)
        noisy = eng.generate([prompt], 12)
        worker, _ = _totals(eng)
        assert worker["loaded_blocks"] == (PROMPT_LEN - 1) // BLOCK_SIZE
        assert noisy != ref
    finally:
        eng.close()


def test_plugin_registers_the_connector_once():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvfabric.ucm_layer.connector import plugin

    plugin.register()
    assert plugin.register() is False  # guarded: a second call is a no-op
    cls = KVConnectorFactory.get_connector_class_by_name("KVFabricConnector")
    from kvfabric.ucm_layer.connector import KVFabricConnector

    assert cls is KVFabricConnector
