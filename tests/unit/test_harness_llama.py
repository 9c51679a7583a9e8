"""The harness's Llama forward: causal GQA attention against a plain reference."""

from __future__ import annotations

import math

import torch

from kvfabric.harness.sparse.llama import Llama
from kvfabric.harness.sparse.model import LlamaConfig


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: int) -> torch.Tensor:
    """Causal softmax attention written out: ``(T, Hq, D)`` -> ``(T, Hq * D)`` (float64)."""
    t, hq, d = q.shape
    kh = k.double().repeat_interleave(group, dim=1)  # (T, Hq, D)
    vh = v.double().repeat_interleave(group, dim=1)
    s = torch.einsum("thd,shd->hts", q.double(), kh) / math.sqrt(d)
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hts,shd->thd", torch.softmax(s, dim=-1), vh)
    return o.reshape(t, hq * d)


def test_causal_attention_matches_reference():
    cfg = LlamaConfig(
        vocab_size=8, dim=64, num_layers=1, num_heads=4, num_kv_heads=2, ffn_dim=8,
        rope_base=10000.0, norm_eps=1e-5, context_length=64,
    )  # fmt: skip
    model = Llama(cfg, {})
    g = torch.Generator().manual_seed(0)
    t = 37
    q = torch.randn(t, 4, 16, generator=g)
    k = torch.randn(t, 2, 16, generator=g)
    v = torch.randn(t, 2, 16, generator=g)
    out = model.causal_attention(q, k, v)
    assert out.shape == (t, 4 * 16) and out.dtype == torch.float32
    ref = _reference(q, k, v, group=2)
    assert torch.allclose(out.double(), ref, atol=1e-5, rtol=1e-5)
    # causality: the first token attends to itself only
    assert torch.allclose(out[0].view(4, 16), v[0].repeat_interleave(2, dim=0), atol=1e-6)
