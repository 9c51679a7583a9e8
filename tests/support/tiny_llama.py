"""A tiny random Llama (same architecture as SmolLM2, a few thousand parameters) for fast
engine and plugin tests that need no download."""

from __future__ import annotations

import torch

from kvfabric.harness.sparse.llama import Llama
from kvfabric.harness.sparse.model import LlamaConfig


def tiny_llama(
    seed: int = 0, layers: int = 2, heads: int = 4, kv_heads: int = 2, head_dim: int = 16
) -> Llama:
    dim = heads * head_dim
    cfg = LlamaConfig(
        vocab_size=97,
        dim=dim,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        ffn_dim=2 * dim,
        rope_base=10000.0,
        norm_eps=1e-5,
        context_length=4096,
    )
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int, std: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    w = {"embed": r(cfg.vocab_size, dim, std=1.0), "norm": torch.ones(dim)}
    w["lm_head"] = w["embed"]
    for i in range(layers):
        w[f"layers.{i}.wq"] = r(dim, dim, std=0.5)
        w[f"layers.{i}.wk"] = r(kv_heads * head_dim, dim, std=0.5)
        w[f"layers.{i}.wv"] = r(kv_heads * head_dim, dim)
        w[f"layers.{i}.wo"] = r(dim, dim)
        w[f"layers.{i}.w_gate"] = r(cfg.ffn_dim, dim)
        w[f"layers.{i}.w_up"] = r(cfg.ffn_dim, dim)
        w[f"layers.{i}.w_down"] = r(dim, cfg.ffn_dim)
        w[f"layers.{i}.attn_norm"] = torch.ones(dim)
        w[f"layers.{i}.ffn_norm"] = torch.ones(dim)
    return Llama(cfg, w)
