"""The ``smollm2`` case of ``kvfabric bench gsa``: real attention and a real decode loop.

For each passkey prompt: one dense prefill (all but the last token) captures every layer's
keys, values and the queries of the last tokens. Then, per method,

* the captured attention is scored like the synthetic workload, every (layer, KV head)
  counted as a head; the needle is the passkey sentence, checked in the heads that put at
  least 10% of their (non-forced) attention on it;
* the engine decodes the answer through the plugin's hooks (the last prompt token is the
  first decode step), and the first answer token's distribution is compared with dense
  (``kl``, KL divergence), as is the answer; ``kl_answer`` is the mean KL over the answer's
  positions with dense's answer fed back (teacher forcing);
* scorers that use the prompt's queries get those of its last ``QUERY_WINDOW`` tokens, as
  the plugin does; methods run at block size 16, and the ``-bs8`` rows at block size 8.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import torch

from kvfabric.bench.report import BenchContext
from kvfabric.bench.sparse.metrics import MethodSpec, block_mass, evaluate
from kvfabric.bench.sparse.synthetic import query_similarity
from kvfabric.harness.sparse.passkey import Passkey, answer, digits, kl_div, passkey_prompt, prefill

#: (label, plugin name, scorer name, plugin options, block size) measured on SmolLM2
#: (``gsa``, no options, block size 16: GSA's defaults, rank 16 of SmolLM2's 64 dimensions)
REAL_METHODS = (
    ("oracle", "oracle", "oracle", {}, 16),
    ("gsa", "gsa", "gsa", {}, 16),
    ("gsa-r16", "gsa", "gsa", {"rank": 16, "basis": "keys"}, 16),
    ("gsa-r16-bound", "gsa", "gsa", {"rank": 16, "select": "bound", "basis": "keys"}, 16),
    ("gsa-r16-qk", "gsa", "gsa", {"rank": 16, "basis": "keys+queries", "query_weight": 0.25}, 16),
    ("quest", "quest", "quest", {}, 16),
    ("meankey", "meankey", "meankey", {}, 16),
    ("hata", "hata", "hata", {}, 16),
    ("oracle-bs8", "oracle", "oracle", {}, 8),
    ("gsa-bs8", "gsa", "gsa", {}, 8),
    ("quest-bs8", "quest", "quest", {}, 8),
)
QUERY_WINDOW = 256  # the plugin's default query_window


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def retrieval_needles(
    q: torch.Tensor, k: torch.Tensor, pk: Passkey, threshold: float = 0.1
) -> list[tuple[int, int, int]]:
    """(head, first, last) of the passkey sentence for heads whose last query puts at least
    ``threshold`` of its attention on it (``q (S, H, G, D)``, ``k (H, T, D)``)."""
    p = torch.softmax(torch.matmul(q[-1], k.transpose(1, 2)) / q.shape[-1] ** 0.5, dim=-1)
    a, b = pk.needle_tokens
    mass = p[..., a : b + 1].sum(-1).amax(-1)  # (H,)
    return [(h, a, b) for h in torch.nonzero(mass >= threshold).flatten().tolist()]


def smollm2_rows(ctx: BenchContext, contexts: list[int], budget: int = 1024) -> Iterator[dict[str, Any]]:
    from kvfabric.harness.sparse import model as mdl
    from kvfabric.harness.sparse.llama import Llama

    try:
        cfg, weights = mdl.load()
        tok = mdl.Tokenizer()
    except (mdl.ModelUnavailable, ImportError) as e:
        _say(f"smollm2 case skipped: {e}")
        return
    llama = Llama(cfg, weights)
    prompts = 1 if ctx.quick else 2
    for n in contexts:
        for seed in range(prompts):
            pk = passkey_prompt(tok, n, seed=seed, depth=0.25 + 0.5 * seed)
            cap = prefill(llama, pk, capture_last=4)
            layers, hkv, t, d = cap.k.shape
            g = cfg.num_heads // cfg.num_kv_heads
            q = cap.q_last.reshape(layers, -1, hkv, g, d).transpose(0, 1).reshape(-1, layers * hkv, g, d)
            k = cap.k.reshape(layers * hkv, t, d)
            v = cap.v.reshape(layers * hkv, t, d)
            pq = None
            if cap.q_prompt is not None:  # (L, M, Hq, D), every stride-th token -> (L * Hkv, m * G, D)
                qp = cap.q_prompt[:, -(QUERY_WINDOW // cap.stride) :]
                m_ = qp.shape[1]
                pq = qp.reshape(layers, m_, hkv, g, d).permute(0, 2, 1, 3, 4).reshape(layers * hkv, -1, d)
            needles = retrieval_needles(q, k, pk)
            p = torch.softmax(torch.matmul(q[-1], k.transpose(1, 2)) / d**0.5, dim=-1)
            top = torch.topk(p, max(1, int(0.02 * t)), -1).values.sum(-1)
            sink = block_mass(p, 16)[..., 0]
            sim = (
                query_similarity(q.transpose(0, 1).reshape(layers * hkv, -1, d), pq) if pq is not None else {}
            )
            _say(
                f"smollm2 {len(pk.ids)} tokens: top2pct_mass={float(top.median()):.3f} "
                f"sink_mass={float(sink.median()):.3f}; {len(needles)} retrieval heads; "
                + ", ".join(f"{k}={v:.3f}" for k, v in sim.items())
            )
            dense_all: list[torch.Tensor] = []
            dense_answer, dense_logits, _ = answer(llama, tok, pk, cap, "dense", {}, all_logits=dense_all)
            forced = [int(x.argmax()) for x in dense_all]
            base = {"case": "smollm2", "prompt_tokens": len(pk.ids), "passkey": pk.answer}
            yield {
                **base,
                "method": "dense",
                "default": False,
                "context": len(pk.ids),
                "budget": len(pk.ids),
                "recall": 1.0,
                "oracle_recall": 1.0,
                "recall_vs_oracle": 1.0,
                "out_err": 0.0,
                "needle_hit": 1.0,
                "bytes_frac": 1.0,
                "speedup_vs_dense": 1.0,
                "answer": dense_answer.strip(),
                "passkey_ok": digits(dense_answer) == pk.answer,
                "kl": 0.0,
            }
            for label, plugin, scorer, opts, bs in REAL_METHODS:
                (qual,) = evaluate(
                    MethodSpec(label, scorer, opts),
                    q,
                    k,
                    v,
                    [budget],
                    block_size=bs,
                    needles=needles,
                    prompt_q=pq,
                )
                config = {"budget_tokens": budget, "min_seq_len": 0, **opts}
                got, logits, st = answer(llama, tok, pk, cap, plugin, config, block_size=bs)
                tf: list[torch.Tensor] = []  # teacher-forced: every answer position, dense's prefix
                answer(llama, tok, pk, cap, plugin, config, block_size=bs, forced=forced, all_logits=tf)
                kl_answer = sum(kl_div(a, b) for a, b in zip(dense_all, tf)) / len(tf)
                yield {
                    **base,
                    "method": label,
                    "default": plugin == "gsa" and not opts and bs == 16,
                    "context": len(pk.ids),
                    "budget": budget,
                    "recall": round(qual.recall, 4),
                    "oracle_recall": round(qual.oracle_recall, 4),
                    "recall_vs_oracle": round(qual.recall_vs_oracle, 4),
                    "out_err": round(qual.out_err, 4),
                    "needle_hit": round(qual.needle_hit, 4),
                    "bytes_frac": round(qual.bytes_frac, 4),
                    "speedup_vs_dense": None,
                    "recall_p10": round(qual.recall_p10, 4),
                    "recall_stale1": round(qual.recall_stale1, 4),
                    "answer": got.strip(),
                    "passkey_ok": digits(got) == pk.answer,
                    "same_as_dense": got == dense_answer,
                    "kl": round(kl_div(dense_logits, logits), 5),
                    "kl_answer": round(kl_answer, 5),
                    "block_size": bs,
                    "summary_numbers": qual.summary_numbers,
                    "step_reuse": round(st.get("step_reuse", float("nan")), 3),
                }
            yield {**base, **_offload_row(llama, tok, pk, cap, budget, dense_answer, dense_logits)}


def _offload_row(
    llama: Any,
    tok: Any,
    pk: Passkey,
    cap: Any,
    budget: int,
    dense_answer: str,
    dense_logits: torch.Tensor,
    steps: int = 7,
) -> dict[str, Any]:
    """GSA with offload through a real ``cache`` store: every block past the sink and the
    ring lives in the store; host-to-device bytes per step as a fraction of dense K+V."""
    from kvfabric.platform.api import create as create_platform
    from kvfabric.ucm_layer.sparse.gsa.offload import store_layout
    from kvfabric.ucm_layer.store import create as create_store

    layers, hkv, t, d = cap.k.shape
    bs = 16
    need = layers * hkv * (t // bs + steps) * 2 * bs * d * 4
    plat = create_platform("sim")
    store = create_store(
        "cache", {"cache.capacity": int(need * 1.25)}, layout=store_layout(bs, d, 4), platform=plat
    )
    try:
        got, logits, st = answer(
            llama,
            tok,
            pk,
            cap,
            "gsa",
            {"budget_tokens": budget, "min_seq_len": 0, "offload": True},
            max_new=steps,
            store=store,
            platform=plat,
        )
    finally:
        store.close()
        plat.close()
    dense_bytes = layers * hkv * len(pk.ids) * d * 2 * 4
    h2d = st.get("h2d_bytes", 0.0) / steps / dense_bytes
    return {
        "method": "gsa-offload",
        "default": False,  # GSA's default options, with offload on
        "context": len(pk.ids),
        "budget": budget,
        "recall": None,
        "oracle_recall": None,
        "recall_vs_oracle": None,
        "out_err": None,
        "needle_hit": None,
        "bytes_frac": round(h2d, 5),
        "speedup_vs_dense": None,
        "h2d_frac": round(h2d, 5),
        "answer": got.strip(),
        "passkey_ok": digits(got) == pk.answer,
        "same_as_dense": got == dense_answer,
        "kl": round(kl_div(dense_logits, logits), 5),
        "step_reuse": round(st.get("step_reuse", float("nan")), 3),
        "demand_blocks": st.get("demand_blocks"),
        "prefetched_blocks": st.get("prefetched_blocks"),
        "prefetch_hits": st.get("prefetch_hits"),
    }


__all__ = ["REAL_METHODS", "retrieval_needles", "smollm2_rows"]
