"""The sparse backend's decode steps without an engine: where a step's time goes.

``python -m kvfabric.bench.sparse.vllm_replay BATCH [STEPS] [OPTIONS_JSON]``: the tiny
Llama's attention geometry (4 layers, 4 query and 2 KV heads of 32 dims, block 32; another
with ``KVFABRIC_REPLAY_GEOMETRY=layers,q_heads,kv_heads,head_dim``, SmolLM2's is
``30,9,3,64``) at ``KVFABRIC_REPLAY_CONTEXT`` tokens (default 32,768) per request, ``BATCH`` requests whose
blocks are scattered over vLLM's CPU cache layout (random keys and values). Each request's
prompt is fitted through :class:`SparseRuntime` (GSA, budget 2,048, ``OPTIONS_JSON`` more
keys), then rounds of ``STEPS`` decode steps alternate between the stock kernel over the full
block tables (dense) and the runtime plus the sparse impl's kernel call (sparse), three
rounds each. Printed per round (medians over its steps): the step, the plan (once per
step), per layer the summary upkeep and selection (``layer_begin``) and the attention
(kernel call and its table). Only the attention work of a step is here (no MLP, sampling or
scheduling): what an engine adds is the engine benchmark's ``dense_short_step_ms``.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
import types
from typing import Any

import torch

L, HQ, H, D, BS = 4, 4, 2, 32, 32


class _Metadata:
    """The fields of vLLM's CPU attention metadata the sparse impl reads."""

    def __init__(self, block_table: torch.Tensor, seq_lens: torch.Tensor, qsl: torch.Tensor) -> None:
        self.block_table, self.seq_lens, self.query_start_loc = block_table, seq_lens, qsl
        self.num_actual_tokens, self.causal = int(qsl[-1]), True


def replay(batch: int, steps: int, options: dict[str, Any], context: int) -> list[dict[str, float]]:
    """Alternating dense and sparse rounds (see the module docstring); one dict per round."""
    from kvfabric.ucm_layer.sparse.base import ModelSpec
    from kvfabric.ucm_layer.sparse.vllm.config import from_mapping
    from kvfabric.ucm_layer.sparse.vllm.cpu import (
        KVFabricCPUSparseImpl,
        run_kernel,
        scheduler_metadata,
        split_cache,
    )
    from kvfabric.ucm_layer.sparse.vllm.runtime import SparseRuntime

    torch.manual_seed(0)
    width = context // BS + 4
    nblocks = batch * width + 8
    caches = [torch.randn(nblocks, H, BS, 2 * D) for _ in range(L)]
    table = torch.randperm(nblocks)[: batch * width].view(batch, width).to(torch.int32)
    cfg = from_mapping({"algorithm": "gsa", "budget_tokens": 2048, **options})
    rt = SparseRuntime(
        cfg, ModelSpec(num_layers=L, num_q_heads=HQ, num_kv_heads=H, head_dim=D, block_size=BS)
    )
    impls = []
    for _ in range(L):  # one impl per layer, as vLLM builds them (the attributes the call reads)
        impl = object.__new__(KVFabricCPUSparseImpl)
        impl.num_heads, impl.head_size, impl.num_kv_heads = HQ, D, H
        impl.scale, impl.kv_cache_dtype, impl.logits_soft_cap = 1 / math.sqrt(D), "auto", 0.0
        impls.append(impl)
    layer = types.SimpleNamespace(isa="vec", _k_scale_float=1.0, _v_scale_float=1.0)
    views = [impls[0]._cache_views(c, layer) for c in caches]
    for i in range(batch):  # prompts, one per step
        md = _Metadata(
            table[i : i + 1],
            torch.tensor([context], dtype=torch.int32),
            torch.tensor([0, context], dtype=torch.int32),
        )
        plan = rt.plan(md, md.block_table, md.seq_lens, md.query_start_loc, nblocks)
        assert plan is not None
        q = torch.randn(context, HQ, D)
        for li in range(L):
            k = views[li].k[:, table[i, : -(-context // BS)].long()].reshape(H, -1, D)[:, :context]
            k = k.transpose(0, 1).contiguous()
            rt.layer_begin(plan, li, (q, k, k), views[li])
            rt.layer_end(plan, li, torch.zeros(context, HQ, D), views[li])
    seq = context
    rounds = []
    for sparse in (False, True) * 3:
        plan_s, upkeep_s, attn_s, step_s = [], [], [], []
        for _ in range(steps):
            if sparse:
                seq += 1
            sl = torch.full((batch,), seq if sparse else context + 1, dtype=torch.int32)
            qsl = torch.arange(batch + 1, dtype=torch.int32)
            md = _Metadata(table, sl, qsl)
            q, k = torch.randn(batch, HQ, D), torch.randn(batch, H, D)
            out = torch.empty(batch, HQ * D)
            t0 = time.perf_counter()
            plan = rt.plan(md, md.block_table, md.seq_lens, md.query_start_loc, nblocks) if sparse else None
            sched = None  # the stock kernel's scheduler metadata: once per step, as vLLM's builder
            t1 = time.perf_counter()
            up = at = 0.0
            for li in range(L):
                kc, vc = split_cache(caches[li])
                a = time.perf_counter()
                # as the impl's forward: the runtime's hooks where there is a plan, the sparse
                # call where this layer selected, the stock kernel everywhere else
                chosen = rt.layer_begin(plan, li, (q, k, k), views[li]) if plan is not None else None
                b = time.perf_counter()
                if chosen is not None:
                    impls[li]._forward_split(layer, q, kc, vc, md, out, chosen)
                else:
                    if sched is None:
                        sched = scheduler_metadata(q, H, sl, qsl, "vec", True)
                    run_kernel(q, kc, vc, out.view(batch, HQ, D), qsl, sl, table, impls[li].scale, sched)
                if plan is not None:
                    rt.layer_end(plan, li, out.view(batch, HQ, D), views[li])
                c = time.perf_counter()
                up, at = up + b - a, at + c - b
            step_s.append(time.perf_counter() - t0)
            plan_s.append(t1 - t0)
            upkeep_s.append(up / L)
            attn_s.append(at / L)
        med = statistics.median
        rounds.append(
            {
                "mode": "sparse" if sparse else "dense",
                "step_ms": med(step_s) * 1e3,
                "plan_ms": med(plan_s) * 1e3,
                "select_per_layer_ms": med(upkeep_s) * 1e3,
                "attention_per_layer_ms": med(attn_s) * 1e3,
            }
        )
    return rounds


def main(argv: list[str]) -> None:
    batch = int(argv[0]) if argv else 1
    steps = int(argv[1]) if len(argv) > 1 else 12
    options = json.loads(argv[2]) if len(argv) > 2 else {}
    context = int(os.environ.get("KVFABRIC_REPLAY_CONTEXT", "32768"))
    geometry = os.environ.get("KVFABRIC_REPLAY_GEOMETRY")
    if geometry:
        global L, HQ, H, D
        try:
            L, HQ, H, D = (int(x) for x in geometry.split(","))
        except ValueError:
            raise SystemExit(
                f"KVFABRIC_REPLAY_GEOMETRY must be layers,q_heads,kv_heads,head_dim, got {geometry!r}"
            ) from None
    for r in replay(batch, steps, options, context):
        print(
            json.dumps(
                {
                    "batch": batch,
                    "context": context,
                    "options": options,
                    **{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()},
                }
            )
        )


if __name__ == "__main__":
    main(sys.argv[1:])
