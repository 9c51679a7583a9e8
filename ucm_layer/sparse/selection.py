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

from kvfabric.settings import coerce_fields, setting


@dataclass(frozen=True)
class SelectionConfig:
    """``budget_tokens`` (absolute) or ``budget_fraction`` (of the sequence) — exactly one.

    Written in kvfabric's configuration language (``kvfabric.settings``): each key is
    checked against its type and range on construction, a bad value is a ``ValueError``
    naming it."""

    budget_tokens: int | None = setting(2048, gt=0, doc="tokens attended per KV head, forced blocks included")
    budget_fraction: float | None = setting(None, gt=0, hi=1, doc="the budget as a share of the sequence")
    sink_blocks: int = setting(1, lo=0, doc="first blocks always read")
    recent_blocks: int = setting(2, lo=0, doc="last blocks always read")
    allocation: str = setting(
        "head",
        choices=("head", "layer"),
        doc="head: every KV head reads the budget; layer: the KV heads of a layer share "
        "num_kv_heads x the budget, the free blocks going where the scores put the most mass",
    )
    head_cap: float = setting(2.0, lo=1, doc="layer allocation: a head reads at most this x its even share")

    def __post_init__(self) -> None:
        coerce_fields(self, lambda key: f"sparse configuration {key}")
        if (self.budget_tokens is None) == (self.budget_fraction is None):
            raise ValueError("give exactly one of budget_tokens and budget_fraction")

    def budget_for(self, seq_len: int) -> int:
        if self.budget_tokens is not None:
            return self.budget_tokens
        return max(1, math.ceil(float(self.budget_fraction) * seq_len))

    def num_selected(self, seq_len: int, block_size: int) -> int:
        """Blocks read per KV head for a sequence of ``seq_len`` tokens (``>= forced``)."""
        nb = -(-seq_len // block_size)
        k = max(self.budget_for(seq_len) // block_size, self.sink_blocks + self.recent_blocks)
        return min(k, nb)


_PER_HEAD = SelectionConfig(budget_tokens=1, sink_blocks=0, recent_blocks=0)  # top_free per head


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
    return torch.cat(
        [
            torch.arange(sink, device=dev).expand(h, sink),
            select_free(combined, nb, k, cfg, priority=priority, share=share, per_head=True),
            torch.arange(nb - recent, nb, device=dev).expand(h, recent),
        ],
        dim=1,
    )


def select_free(
    scores: torch.Tensor,
    nb: int,
    k: int,
    cfg: SelectionConfig,
    *,
    priority: torch.Tensor | None = None,
    share: float = 0.0,
    per_head: bool = False,
) -> torch.Tensor:
    """The ``k - forced`` free blocks of a selection, as block indices ``(H, c)`` into
    ``scores (H, >= nb)``: those between the forced sink and recent blocks that rank best by
    ``scores`` (and ``priority``, see ``top_free``), by ``cfg.allocation`` unless
    ``per_head``; entries a head does not use are -1; ``(H, 0)`` when nothing is free."""
    sink, recent = forced_blocks(nb, cfg)
    free = k - sink - recent
    if free <= 0:
        return torch.empty((scores.shape[0], 0), dtype=torch.int64, device=scores.device)
    prio = None if priority is None else priority[:, sink : nb - recent]
    idx = top_free(scores[:, sink : nb - recent], free, _PER_HEAD if per_head else cfg, prio, share)
    return torch.where(idx >= 0, idx + sink, idx)


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


__all__ = [
    "SelectionConfig",
    "combine_group",
    "forced_blocks",
    "lens_of",
    "select_blocks",
    "select_free",
    "top_free",
]
