"""Decode attention kernels in plain torch, on whatever device the tensors live on.

Layouts: queries of one request are ``(num_kv_heads, group, head_dim)`` (GQA: the query
heads of one KV head side by side); a paged cache is ``(num_kv_heads, num_blocks,
block_size, head_dim)`` (see :class:`~kvfabric.ucm_layer.sparse.base.LayerKV`); a block
table is ``(H, n)`` with ``H`` 1 or ``num_kv_heads``. Nothing here synchronises with the
host: shapes are known from the arguments, and masks are built as tensors.
"""

from __future__ import annotations

import math

import torch


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Softmax attention of ``q (H, G, D)`` over ``k, v (H, N, D)``; ``mask (H, N)`` bool
    (True = attend) or None. Returns ``(H, G, D)``."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = torch.matmul(q, k.transpose(1, 2))
    s.mul_(scale)
    if mask is not None:
        s.masked_fill_(~mask[:, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.matmul(p, v)


def attention_probs(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``softmax(q k^T / sqrt(D))``: ``(H, G, N)`` for ``q (H, G, D)``, ``k (H, N, D)``."""
    s = torch.matmul(q, k.transpose(1, 2)) * (1.0 / math.sqrt(q.shape[-1]))
    return torch.softmax(s, dim=-1)


def gather_blocks(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Blocks ``table (H, n)`` (or ``(1, n)`` shared by every head) of ``cache (H, NB, bs, D)``
    as one ``(H, n * bs, D)`` tensor (one index_select over contiguous (head, block) rows)."""
    h, nb, bs, d = cache.shape
    if table.shape[0] == 1 and h > 1:
        table = table.expand(h, -1)
    flat = (table + torch.arange(h, device=table.device).unsqueeze(1) * nb).reshape(-1)
    return cache.reshape(h * nb, bs, d).index_select(0, flat).reshape(h, -1, d)


def block_mask(block_lens: torch.Tensor, block_size: int, num_heads: int) -> torch.Tensor:
    """``(H, n * bs)`` bool mask from ``block_lens (H or 1, n)``: token j of a listed block is
    valid when ``j < block_lens``."""
    offs = torch.arange(block_size, device=block_lens.device)
    m = offs.view(1, 1, -1) < block_lens.unsqueeze(-1)
    if m.shape[0] == 1 and num_heads > 1:
        m = m.expand(num_heads, -1, -1)
    return m.reshape(m.shape[0], -1)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    block_lens: torch.Tensor,
    full_tail: bool = False,
) -> torch.Tensor:
    """Attention of one request's decode query ``q (H, G, D)`` over the listed blocks.

    ``full_tail=True`` promises that every listed block is full (no mask needed)."""
    k = gather_blocks(k_cache, table)
    v = gather_blocks(v_cache, table)
    mask = None if full_tail else block_mask(block_lens, k_cache.shape[2], k_cache.shape[0])
    return attend(q, k, v, mask)


def dense_table(seq_len: int, blocks: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense view of a request: its physical ``blocks`` (n,) as a ``(1, nb)`` table and
    the ``(1, nb)`` valid-token counts for ``seq_len`` tokens."""
    nb = -(-seq_len // block_size)
    if nb > blocks.numel():
        raise ValueError(
            f"{seq_len} tokens need {nb} blocks of {block_size}; the request has {blocks.numel()}"
        )
    lens = torch.full((1, nb), block_size, dtype=torch.int64, device=blocks.device)
    lens[0, -1] = seq_len - (nb - 1) * block_size
    return blocks[:nb].reshape(1, nb).to(torch.int64), lens


__all__ = ["attend", "attention_probs", "block_mask", "dense_table", "gather_blocks", "paged_attention"]
