"""The vLLM part of ``kvfabric demo``: the KV connector in a real engine, TTFT cold and warm.

SmolLM2-135M-Instruct when it can be fetched (else a tiny random Llama), the CPU build
of vLLM, kvfabric's default store in a temporary directory. The same prompt runs twice
with vLLM's own prefix cache off: the first time it is computed (and stored), the second
time its prefix is loaded through kvfabric; the first generated token must match.
``quick``: the tiny random Llama with a 256-token prompt (the same steps and checks).
"""

from __future__ import annotations

import shutil
import tempfile
from typing import Any

import numpy as np
from rich.markup import escape
from rich.table import Table

PROMPT_TOKENS = 1024
QUICK_PROMPT_TOKENS = 256


def run_connector_demo(con: Any, quick: bool = False) -> bool:
    """Print the connector's figures; True when the run was correct (or vLLM is absent)."""
    from kvfabric.harness.engine import kvfabric_transfer_config, make_engine, vllm_problem
    from kvfabric.harness.models import ModelUnavailable, smollm2, tiny_llama
    from kvfabric.ucm_layer.connector.config import default_store

    problem = vllm_problem()
    if problem:
        con.print(f"[yellow]vLLM part skipped[/]: {escape(problem)}")
        return True
    try:
        if quick:
            model, name, vocab = tiny_llama(), "tiny random Llama", 512
        else:
            model, name, vocab = smollm2(), "SmolLM2-135M-Instruct", 49152
    except ModelUnavailable as e:
        con.print(f"[yellow]SmolLM2 unavailable ({escape(str(e))}); using a tiny random Llama[/]")
        model, name, vocab = tiny_llama(), "tiny random Llama", 512
    store = default_store()
    tmp = tempfile.mkdtemp(prefix="kvf-demo-")
    con.print(f"vLLM engine on CPU with kvfabric ({store}, files in {tmp}), model {name} ...")
    n = QUICK_PROMPT_TOKENS if quick else PROMPT_TOKENS
    prompt = np.random.default_rng(1).integers(3, vocab, n).tolist()
    try:
        cfg = kvfabric_transfer_config(store, tmp, cache_bytes="256MiB", pool_bytes="256MiB")
        eng = make_engine(model, cfg, kv_bytes=256 << 20, max_model_len=4096)
        try:
            eng.ttft(prompt[:64][::-1])  # warm-up request
            cold = eng.ttft(prompt)
            cold_tok = eng.last_tokens
            eng.flush()
            warm = eng.ttft(prompt)
            warm_tok = eng.last_tokens
            totals = eng.worker().stats.totals
        finally:
            eng.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    t = Table("request", "prompt tokens", "time to first token", "blocks loaded", "first token")
    t.add_row("cold (computed, then stored)", str(len(prompt)), f"{cold * 1e3:.0f} ms", "0", str(cold_tok))
    t.add_row(
        "warm (prefix loaded via kvfabric)",
        str(len(prompt)),
        f"{warm * 1e3:.0f} ms",
        str(totals["loaded_blocks"]),
        str(warm_tok),
    )
    con.print(t)
    good = cold_tok == warm_tok and totals["loaded_blocks"] > 0
    con.print(
        f"TTFT cold / warm: {cold / warm:.1f}x; "
        + ("same first token" if cold_tok == warm_tok else "[red]DIFFERENT first token[/]")
    )
    return good
