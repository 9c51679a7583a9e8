"""A small torch forward of the Llama architecture (RMSNorm, RoPE, GQA, SwiGLU).

Enough to run SmolLM2-135M on CPU: ``prefill`` runs a prompt with causal attention and can
capture every layer's queries, keys and values; the pieces (``qkv``, ``attn_out``,
``mlp``, ``logits``) are what the paged engine (``engine``) composes for decode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvfabric.harness.sparse.model import LlamaConfig
from kvfabric.harness.sparse.rope import apply_rope, rope_tables


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@dataclass(frozen=True)
class Capture:
    """What ``prefill`` captured: keys/values ``(L, Hkv, T, D)`` of every token, the
    queries ``(L, S, Hq, D)`` of the last ``S`` tokens, and the queries
    ``(L, ceil(T / stride), Hq, D)`` of every ``stride``-th prompt token (post-RoPE, as
    attention sees them)."""

    k: torch.Tensor
    v: torch.Tensor
    q_last: torch.Tensor
    q_prompt: torch.Tensor | None = None
    stride: int = 8


class Llama:
    """Weights from ``model.load``; all methods are pure functions of their arguments."""

    def __init__(self, cfg: LlamaConfig, weights: dict[str, torch.Tensor]) -> None:
        self.cfg = cfg
        self.w = weights

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.w["embed"][ids]

    def qkv(self, layer: int, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``(T, Hq, D)``, ``(T, Hkv, D)``, ``(T, Hkv, D)`` for hidden states ``x (T, dim)``;
        q and k rotated at ``positions``."""
        c, w = self.cfg, self.w
        h = rms_norm(x, w[f"layers.{layer}.attn_norm"], c.norm_eps)
        t = x.shape[0]
        q = (h @ w[f"layers.{layer}.wq"].t()).view(t, c.num_heads, c.head_dim)
        k = (h @ w[f"layers.{layer}.wk"].t()).view(t, c.num_kv_heads, c.head_dim)
        v = (h @ w[f"layers.{layer}.wv"].t()).view(t, c.num_kv_heads, c.head_dim)
        cos, sin = rope_tables(positions, c.head_dim, c.rope_base)
        q = apply_rope(q.transpose(0, 1), cos, sin).transpose(0, 1)
        k = apply_rope(k.transpose(0, 1), cos, sin).transpose(0, 1)
        return q.contiguous(), k.contiguous(), v.contiguous()

    def attn_out(self, layer: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual add of the output projection of ``attn (T, Hq * D)``, then the MLP."""
        x = x + attn @ self.w[f"layers.{layer}.wo"].t()
        return x + self.mlp(layer, x)

    def mlp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        w = self.w
        h = rms_norm(x, w[f"layers.{layer}.ffn_norm"], self.cfg.norm_eps)
        return (F.silu(h @ w[f"layers.{layer}.w_gate"].t()) * (h @ w[f"layers.{layer}.w_up"].t())) @ w[
            f"layers.{layer}.w_down"
        ].t()

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.w["norm"], self.cfg.norm_eps) @ self.w["lm_head"].t()

    def causal_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal GQA attention over a prompt: ``(T, Hq, D)`` -> ``(T, Hq * D)``."""
        g = self.cfg.num_heads // self.cfg.num_kv_heads
        # 4-D (batch 1, heads, T, D): with 3-D tensors torch's CPU kernel takes a slow path
        # (8x slower at 4K tokens, same result)
        qh = q.transpose(0, 1).unsqueeze(0)
        kh = k.transpose(0, 1).repeat_interleave(g, dim=0).unsqueeze(0)
        vh = v.transpose(0, 1).repeat_interleave(g, dim=0).unsqueeze(0)
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)[0]
        return o.transpose(0, 1).reshape(q.shape[0], -1)

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor, capture_last: int = 0) -> tuple[torch.Tensor, Capture | None]:
        """Logits ``(T, vocab)`` of a prompt ``ids (T,)`` and, if ``capture_last``, a
        :class:`Capture`."""
        t = ids.shape[0]
        pos = torch.arange(t)
        x = self.embed(ids)
        ks, vs, qs, qp = [], [], [], []
        for layer in range(self.cfg.num_layers):
            q, k, v = self.qkv(layer, x, pos)
            if capture_last:
                ks.append(k.transpose(0, 1))
                vs.append(v.transpose(0, 1))
                qs.append(q[t - capture_last :])
                qp.append(q[::8])
            x = self.attn_out(layer, x, self.causal_attention(q, k, v))
        cap = (
            Capture(torch.stack(ks), torch.stack(vs), torch.stack(qs), torch.stack(qp), 8)
            if capture_last
            else None
        )
        return self.logits(x), cap


__all__ = ["Capture", "Llama", "rms_norm"]
