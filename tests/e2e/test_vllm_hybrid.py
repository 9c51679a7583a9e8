"""kvfabric's connector with a hybrid model (sliding-window and full attention layers)
inside a real vLLM engine (CPU build), greedy sampling, vLLM's own prefix cache off.

The connector is ``SupportsHMA``, so vLLM keeps its hybrid KV cache manager on: two KV
cache groups (the sliding-window layers and the full-attention ones). The same prompt
twice: the second run loads its prefix through kvfabric (every full-attention block, and
the sliding-window blocks of the last window only) and generates the same tokens. When
the stored bytes went bad between runs, the load fails per request (vLLM takes no
block-level failures with several groups), vLLM recomputes it and the tokens are the
same again.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from kvfabric.harness.engine import BLOCK_SIZE, kvfabric_transfer_config, make_engine

PROMPT_LEN = 300  # 9 full blocks can load; the 10th holds the last prompt token
WINDOW = 64  # tiny_hybrid's sliding window (tokens)
HIT_BLOCKS = (PROMPT_LEN - 1) // BLOCK_SIZE
# the sliding-window group keeps the blocks of tokens [H - WINDOW + 1, H)
WINDOW_BLOCKS = HIT_BLOCKS - (HIT_BLOCKS * BLOCK_SIZE - WINDOW + 1) // BLOCK_SIZE


@pytest.fixture(scope="module")
def tiny_hybrid() -> str:
    from kvfabric.harness.models import tiny_hybrid

    return str(tiny_hybrid())


def _prompt(seed: int, vocab: int = 512, n: int = PROMPT_LEN) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, n).tolist()


def _totals(engine):
    w = engine.worker()
    sched = next(c.scheduler for c in engine.connectors() if c.scheduler is not None)
    return w.stats.totals, sched.stats.totals


def _block_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".") and "tmp" not in p.name]


def _engine(model: str, root: Path, **extra):
    return make_engine(model, kvfabric_transfer_config("posix", root, **extra), kv_bytes=64 << 20)


@pytest.mark.parametrize("delegator", [False, True], ids=["direct", "delegator"])
def test_hybrid_model_keeps_the_hybrid_manager_and_loads_through_kvfabric(tiny_hybrid, tmp_path, delegator):
    eng = _engine(tiny_hybrid, tmp_path, delegator=delegator)
    try:
        assert eng.llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
        w = eng.worker()
        assert len(w.groups) == 2 and w.expected_layout == w.layout.signature
        assert all(d.enabled is delegator for d in w.delegators)
        prompt = _prompt(1)
        first = eng.generate([prompt], 12)
        eng.flush()
        worker, sched = _totals(eng)
        assert worker["loaded_blocks"] == 0 and worker["saved_blocks"] >= 2 * HIT_BLOCKS
        second = eng.generate([prompt], 12)
        worker, sched = _totals(eng)
        assert second == first
        assert sched["external_hit_tokens"] == HIT_BLOCKS * BLOCK_SIZE
        assert worker["loaded_blocks"] == HIT_BLOCKS + WINDOW_BLOCKS
        assert worker["load_failed_blocks"] == 0
    finally:
        eng.close()


def test_hybrid_model_recomputes_a_request_whose_stored_bytes_went_bad(tiny_hybrid, tmp_path):
    prompt = _prompt(2)
    eng = _engine(tiny_hybrid, tmp_path)
    try:
        ref = eng.generate([prompt], 12)
        eng.flush()
        layout = eng.worker().store.layout
        payload = layout.num_shards * layout.shard_bytes
        rng = np.random.default_rng(3)
        files = _block_files(tmp_path)
        assert files
        for f in files:  # same-size noise over each block's bytes: the checksums catch it
            noise = (rng.standard_normal(payload // 4) * 3).astype(np.float32).tobytes()
            with open(f, "r+b") as fh:
                assert os.pwrite(fh.fileno(), noise, 0) == payload
        got = eng.generate([prompt], 12)
        worker, sched = _totals(eng)
        assert got == ref
        assert worker["load_failed_blocks"] > 0
        assert sched["repair_blocks"] > 0
    finally:
        eng.close()
