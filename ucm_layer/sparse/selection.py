"""Top-k block selection under a token budget, with forced sink and recent blocks.

Every algorithm (GSA and the baselines) scores blocks per KV head; this module turns those
scores into the blocks the kernel reads. The budget counts every attended token, forced
blocks included: ``k = budget // block_size`` blocks per KV head, of which the first
``sink_blocks`` and the last ``recent_blocks`` are always kept and ``k - forced`` are the
top-scoring blocks in between. All of it is tensor work on the scores' device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SelectionConfig:
    """``budget_tokens`` (absolute) or ``budget_fraction`` (of the sequence) — exactly one."""

    budget_tokens: int | None = 2048
    budget_fraction: float | None = None
    sink_blocks: int = 1
    recent_blocks: int = 2

    def __post_init__(self) -> None:
        if (self.budget_tokens is None) == (self.budget_fraction is None):
            raise ValueError("give exactly one of budget_tokens and budget_fraction")
        if self.budget_tokens is not None and (
            isinstance(self.budget_tokens, bool)
            or not isinstance(self.budget_tokens, int)
            or self.budget_tokens <= 0
        ):
            raise ValueError(f"budget_tokens must be a positive int, got {self.budget_tokens!r}")
        if self.budget_fraction is not None and not 0.0 < float(self.budget_fraction) <= 1.0:
            raise ValueError(f"budget_fraction must be in (0, 1], got {self.budget_fraction!r}")
        for name in ("sink_blocks", "recent_blocks"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")

    def budget_for(self, seq_len: int) -> int:
        if self.budget_tokens is not None:
            return self.budget_tokens
        return max(1, math.ceil(float(self.budget_fraction) * seq_len))

    def num_selected(self, seq_len: int, block_size: int) -> int:
        """Blocks read per KV head for a sequence of ``seq_len`` tokens (``>= forced``)."""
        nb = -(-seq_len // block_size)
        k = max(self.budget_for(seq_len) // block_size, self.sink_blocks + self.recent_blocks)
        return min(k, nb)


def combine_group(scores: torch.Tensor, how: str, scale: float = 1.0) -> torch.Tensor:
    """Per-query-head block scores ``(H, G, nb)`` -> one score per KV head block ``(H, nb)``.

    ``softmax``: each query head's scores become a distribution over blocks (``scale`` is
    the logit scale) and the group's distributions are summed — the estimated attention
    mass of the block for the whole group. ``max``: the best score any head gives.
    ``sum``: plain sum (scores that are already masses)."""
    if how == "softmax":
        return torch.softmax(scores * scale, dim=-1).sum(dim=1)
    if how == "max":
        return scores.amax(dim=1)
    if how == "sum":
        return scores.sum(dim=1)
    raise ValueError(f"unknown group combination {how!r}; use softmax, max or sum")


def forced_blocks(nb: int, cfg: SelectionConfig) -> tuple[int, int]:
    """``(sink, recent)`` block counts actually forced for ``nb`` blocks."""
    sink = min(cfg.sink_blocks, nb)
    recent = min(cfg.recent_blocks, nb - sink)
    return sink, recent


def select_blocks(combined: torch.Tensor, nb: int, k: int, cfg: SelectionConfig) -> torch.Tensor:
    """Indices ``(H, k)`` (int64) of the blocks to read: forced sink blocks, forced recent
    blocks, then the ``k - forced`` best of ``combined[:, :nb]`` in between (by score)."""
    h = combined.shape[0]
    dev = combined.device
    sink, recent = forced_blocks(nb, cfg)
    if k >= nb:
        return torch.arange(nb, device=dev).expand(h, nb)
    free = k - sink - recent
    parts = [torch.arange(sink, device=dev).expand(h, sink)]
    if free > 0:
        mid = combined[:, sink : nb - recent]
        parts.append(torch.topk(mid, free, dim=-1, sorted=False).indices + sink)
    parts.append(torch.arange(nb - recent, nb, device=dev).expand(h, recent))
    return torch.cat(parts, dim=1)


def lens_of(indices: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """Valid tokens of each selected block (only the last logical block can be partial)."""
    nb = -(-seq_len // block_size)
    tail = seq_len - (nb - 1) * block_size
    full = torch.full_like(indices, block_size)
    return torch.where(indices == nb - 1, torch.full_like(indices, tail), full)


__all__ = ["SelectionConfig", "combine_group", "forced_blocks", "lens_of", "select_blocks"]
