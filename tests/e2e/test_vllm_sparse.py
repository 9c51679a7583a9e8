"""GSA inside a real vLLM engine (CPU build) through kvfabric's attention backend, no patches.

SmolLM2-135M serves a ~2K-token passkey prompt twice: with vLLM's stock CPU backend and
with GSA on (``KVFABRIC_SPARSE``: budget 512 tokens, the switch at 1,024 tokens, the
cost-aware floor off). GSA must
have selected blocks (the backend's stats file: sparse layer steps, fewer blocks read than
the dense kernel would) and answer like dense; a prompt below the switch threshold must
give the stock backend's tokens exactly. Engines run in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the same backend classes as in a worker process.
"""

from __future__ import annotations

import json

import pytest

from kvfabric.harness.engine import make_engine

LONG, SHORT, NEW = 2000, 500, 6
BUDGET, SWITCH = 512, 1024


@pytest.fixture(scope="module")
def prompts():
    from kvfabric.harness.sparse.model import ModelUnavailable, Tokenizer
    from kvfabric.harness.sparse.passkey import passkey_prompt

    try:
        tok = Tokenizer()
    except (ModelUnavailable, ImportError) as e:
        pytest.skip(f"SmolLM2 tokenizer unavailable: {e}")
    return passkey_prompt(tok, LONG, seed=5, depth=0.4), passkey_prompt(tok, SHORT, seed=6, depth=0.5), tok


def _serve(model: str, prompts: list[list[int]]) -> list[list[int]]:
    eng = make_engine(model, None, kv_bytes=160 << 20, max_model_len=3072)
    try:
        return [eng.generate([p], max_tokens=NEW)[0] for p in prompts]
    finally:
        eng.close()


@pytest.fixture(scope="module")
def served(smol_model, prompts, tmp_path_factory):
    long, short, _ = prompts
    ids = [long.ids, short.ids]
    mp = pytest.MonkeyPatch()
    try:
        mp.delenv("KVFABRIC_SPARSE", raising=False)
        dense = _serve(smol_model, ids)
        stats = tmp_path_factory.mktemp("sparse") / "stats.json"
        cfg = {
            "algorithm": "gsa",
            "budget_tokens": BUDGET,
            "min_seq_len": SWITCH,
            # one ~2K request skips 1,488 x 3 x 64 key elements a layer, under the engine's
            # cost-aware floor (docs/sparse.md): this test is about selection, so no floor
            "min_skipped_kv": 0,
            "stats_path": str(stats),
        }
        mp.setenv("KVFABRIC_SPARSE", json.dumps(cfg))
        sparse = _serve(smol_model, ids)
    finally:
        mp.undo()
    return dense, sparse, json.loads(stats.read_text())


def test_gsa_selects_blocks_in_vllm_and_answers_like_dense(served, prompts):
    dense, sparse, stats = served
    long, _, tok = prompts
    assert long.answer in tok.decode(dense[0])  # the prompt is one dense SmolLM2 solves
    assert sparse[0] == dense[0]
    assert stats["algorithm"] == "gsa" and stats["requests"] == 2
    assert stats["sparse_layer_steps"] > 0 and stats["plugin"]["selections"] > 0
    assert 0 < stats["blocks_selected"] < stats["blocks_total"]
    assert stats["blocks_selected"] <= stats["sparse_layer_steps"] * (BUDGET // 32)
    assert all(layer["sparse"] > 0 for layer in stats["layers"])


def test_below_the_switch_threshold_tokens_equal_the_stock_backend(served):
    dense, sparse, stats = served
    assert sparse[1] == dense[1]
    assert len(stats["layers"]) == 30 and stats["dense_layer_steps"] >= 30 * (NEW - 1)
