"""Repair in a real vLLM engine (CPU build, SmolLM2, posix store): a block whose load
fails is recomputed by vLLM and saved again, so the next request hits.

Run 1 (cold) stores the prompt's blocks. Between runs one block file gets same-size
noise (its checksum fails: ``CORRUPT``, the store drops it) and a later one is deleted.
Run 2 loads the prefix up to the deleted block, the noisy one fails, vLLM recomputes
from it, and the connector dumps every block from the failed one on again (the tokens
are the cold run's). Run 3 loads every full block, none fails, same tokens.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from kvfabric.harness.engine import BLOCK_SIZE, kvfabric_transfer_config, make_engine
from kvfabric.ucm_layer.connector import metrics
from kvfabric.ucm_layer.store.base import BlockStatus


class RecordIds:
    """Wraps the scheduler role's id function (a plain callable): keeps the ids it made,
    in order, so the test knows which file holds which block of the prompt."""

    def __init__(self, fn) -> None:
        self.fn, self.rows = fn, []

    def __call__(self, hashes, parent):
        out = self.fn(hashes, parent)
        self.rows.extend(out)
        return out


def _block_files(eng, ids: list[np.ndarray]) -> list[Path]:
    """The posix store's file of each block (rank 0's ids), in prompt order."""
    from kvfabric.ucm_layer import hashing

    store = eng.worker().store
    return [Path(p) for p in store.files.paths(hashing.tag(np.stack(ids), 0, 0))]


def _noise(path: Path, payload: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    noise = (rng.standard_normal(payload // 4) * 3).astype(np.float32).tobytes()
    size = path.stat().st_size
    with open(path, "r+b") as fh:
        assert os.pwrite(fh.fileno(), noise, 0) == payload
    assert path.stat().st_size == size


@pytest.mark.parametrize("extra", [{}, {"layerwise": True}], ids=["whole", "layerwise"])
def test_failed_blocks_are_saved_again_and_the_next_run_hits(smol_model, tmp_path, extra):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smol_model)
    prompt = tok("The tides of the inner sea were charted by hand for three centuries. " * 20)["input_ids"]
    blocks = (len(prompt) - 1) // BLOCK_SIZE
    assert blocks >= 6
    eng = make_engine(
        smol_model,
        kvfabric_transfer_config("posix", tmp_path, **extra),
        kv_bytes=128 << 20,
        max_model_len=1024,
    )
    sched = next(c.scheduler for c in eng.connectors() if c.scheduler is not None)
    record = sched._ids_from_hashes = RecordIds(sched._ids_from_hashes)
    try:
        cold = eng.generate([prompt], 8)
        eng.flush()
        worker = eng.worker()
        files = _block_files(eng, record.rows[:blocks])
        assert all(f.is_file() for f in files)
        base = worker.stats.totals.copy()
        bad, gone = 2, 5
        layout = worker.store.layout
        _noise(files[bad], layout.num_shards * layout.shard_bytes, seed=3)
        files[gone].unlink()

        again = eng.generate([prompt], 8)
        eng.flush()
        t = worker.stats.totals
        assert again == cold
        assert t["loaded_blocks"] - base["loaded_blocks"] == gone - 1  # up to the deleted one, less the bad
        corrupt = metrics.failure_counter(metrics.failure_reason(BlockStatus.CORRUPT))
        missing = metrics.failure_counter(metrics.failure_reason(BlockStatus.MISSING))
        assert t["load_failed_blocks"] - base["load_failed_blocks"] == 1  # the bad block, once
        assert worker.store.stats()["corrupt_blocks"] >= 1  # its checksum failed: dropped
        if extra.get("layerwise"):
            # each layer's shard is read on its own: the first read of the bad block drops
            # its file, so the layer waited for first may find it gone (counted as missing)
            found = {k: t.get(k, 0) - base.get(k, 0) for k in (corrupt, missing)}
            assert sum(found.values()) == 1, found
        else:
            assert t[corrupt] - base[corrupt] == 1
        assert sched.stats.totals["repair_blocks"] >= gone - bad
        assert all(f.is_file() for f in files[:blocks])  # saved again, the deleted one too

        mid = worker.stats.totals.copy()
        third = eng.generate([prompt], 8)
        t = worker.stats.totals
        assert third == cold
        assert t["loaded_blocks"] - mid["loaded_blocks"] == blocks
        assert t["load_failed_blocks"] == mid["load_failed_blocks"]
    finally:
        eng.close()
