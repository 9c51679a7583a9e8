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
    # "head": every KV head reads the budget; "layer": the KV heads of a layer share
    # num_kv_heads x the budget, the free blocks going where the scores put the most mass,
    # a head reading at most head_cap x its even share of free blocks
    allocation: str = "head"
    head_cap: float = 2.0

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
        if self.allocation not in ("head", "layer"):
            raise ValueError(f"allocation must be 'head' or 'layer', got {self.allocation!r}")
        if (
            isinstance(self.head_cap, bool)
            or not isinstance(self.head_cap, (int, float))
            or self.head_cap < 1
        ):
            raise ValueError(f"head_cap must be a number >= 1, got {self.head_cap!r}")

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


def select_blocks(
    combined: torch.Tensor,
    nb: int,
    k: int,
    cfg: SelectionConfig,
    priority: torch.Tensor | None = None,
    share: float = 0.0,
) -> torch.Tensor:
    """Indices ``(H, k)`` (int64) of the blocks to read: forced sink blocks, forced recent
    blocks, then the ``k - forced`` best of ``combined[:, :nb]`` in between (by score; a
    ``share`` of them by ``priority`` first, see ``top_free``). Per-head allocation."""
    h = combined.shape[0]
    dev = combined.device
    sink, recent = forced_blocks(nb, cfg)
    if k >= nb:
        return torch.arange(nb, device=dev).expand(h, nb)
    free = k - sink - recent
    parts = [torch.arange(sink, device=dev).expand(h, sink)]
    if free > 0:
        mid = combined[:, sink : nb - recent]
        prio = None if priority is None else priority[:, sink : nb - recent]
        head = SelectionConfig(budget_tokens=1, sink_blocks=0, recent_blocks=0)
        parts.append(top_free(mid, free, head, prio, share) + sink)
    parts.append(torch.arange(nb - recent, nb, device=dev).expand(h, recent))
    return torch.cat(parts, dim=1)


def top_free(
    mid: torch.Tensor,
    free: int,
    cfg: SelectionConfig,
    priority: torch.Tensor | None = None,
    share: float = 0.0,
) -> torch.Tensor:
    """The free blocks ``(H, c)`` (indices into ``mid (H, M)``) for ``free`` blocks per KV
    head: the per-head top ``free`` (``allocation="head"``, ``c = free``), or the top
    ``H * free`` of the whole layer with at most ``c = min(M, ceil(head_cap * free))`` per
    head (``"layer"``; entries a head does not use are -1). With ``priority (H, M)`` and a
    ``share``, each head's ``round(share * free)`` best blocks by ``priority`` are taken
    first, the rest by ``mid``."""
    h, m = mid.shape
    first = min(free, round(share * free)) if priority is not None else 0
    if first > 0:
        top = torch.topk(priority, first, dim=-1, sorted=False).indices
        mid = mid.scatter(1, top, float("inf"))
    if cfg.allocation == "head" or h == 1:
        return torch.topk(mid, free, dim=-1, sorted=False).indices
    cap = min(m, math.ceil(cfg.head_cap * free))
    vals, idx = torch.topk(mid, cap, dim=-1, sorted=False)
    chosen = torch.topk(vals.reshape(-1), h * free, sorted=False).indices
    keep = torch.zeros(h * cap, dtype=torch.bool, device=mid.device).scatter_(0, chosen, True)
    return torch.where(keep.view(h, cap), idx, torch.full_like(idx, -1))


def lens_of(indices: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """Valid tokens of each selected block (only the last logical block can be partial)."""
    nb = -(-seq_len // block_size)
    tail = seq_len - (nb - 1) * block_size
    full = torch.full_like(indices, block_size)
    return torch.where(indices == nb - 1, torch.full_like(indices, tail), full)


__all__ = ["SelectionConfig", "combine_group", "forced_blocks", "lens_of", "select_blocks", "top_free"]
