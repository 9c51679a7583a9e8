"""Rotary position embedding, "rotate half" convention (the layout HF Llama checkpoints use)."""

from __future__ import annotations

import torch


def rope_tables(positions: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of shape ``(n, head_dim)`` for integer ``positions (n,)``."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    ang = positions.to(torch.float64).unsqueeze(1) * inv.unsqueeze(0)
    ang = torch.cat([ang, ang], dim=1)
    return ang.cos().to(torch.float32), ang.sin().to(torch.float32)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x (..., n, D)`` by the tables ``(n, D)``."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


__all__ = ["apply_rope", "rope_tables"]
