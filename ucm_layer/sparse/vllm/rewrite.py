"""A plugin's block selection -> the block table and lengths a paged kernel reads.

A ``UcmSparseBase`` plugin replaces a request's view with, per KV head, the physical
blocks it selected and their valid token counts (``(H, k)`` tables and lengths; a length of
0 marks an entry the head does not use). vLLM's paged kernels read one block table row
per sequence, every block full except the last (``seq_len`` tokens in all), so a row
lists the full blocks first and the partial block (if any) last; order among full blocks
does not matter (softmax is permutation-invariant).

``fold_heads`` (per-(request, layer, KV head) selection): on caches whose block holds the
heads one after another (vLLM CPU: ``(num_blocks, H, block_size, 2 * D)``), the view
``(num_blocks * H, 1, block_size, ...)`` makes (block ``b``, head ``h``) block
``b * H + h`` of a one-KV-head cache, so every (request, head) becomes a sequence of its
own with the ``G`` query heads of that KV head: ``G`` query rows per sequence, one
kernel call for the whole batch. ``union_rows`` (per-(request, layer) selection, for
caches whose heads are interleaved inside a block, e.g. FlashAttention's
``(2, num_blocks, block_size, H, D)``): the union of the heads' blocks in one row.
Pure torch on the tables' device; nothing here synchronises except ``union_rows``'s
per-request ``unique``.
"""

from __future__ import annotations

import torch


def pack_rows(tables: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``tables, lens (R, k)`` -> ``(block_table (R, k) int32, seq_lens (R,) int32)``: each
    row's used entries with full blocks first and the partial one last (unused entries
    point at the row's first block and lie past ``seq_lens``)."""
    if tables.shape != lens.shape or tables.dim() != 2:
        raise ValueError(
            f"tables and lens must be equal (R, k) shapes, got {tuple(tables.shape)}, {tuple(lens.shape)}"
        )
    order = torch.sort(lens, dim=1, descending=True, stable=True).indices
    t = tables.gather(1, order)
    ln = lens.gather(1, order)
    t = torch.where(ln > 0, t, t[:, :1])
    return t.to(torch.int32), ln.sum(dim=1).to(torch.int32)


def fold_heads(tables: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head selections ``tables, lens (S, H, k)`` of ``S`` requests -> rows of the folded
    one-head cache: ``(S * H, k)`` block table (block ``b`` of head ``h`` is ``b * H + h``)
    and ``(S * H,)`` lengths, sequence ``s * H + h`` being request ``s``'s head ``h``."""
    if tables.dim() != 3 or tables.shape != lens.shape:
        raise ValueError(f"tables and lens must be equal (S, H, k) shapes, got {tuple(tables.shape)}")
    s, h, k = tables.shape
    heads = torch.arange(h, device=tables.device, dtype=tables.dtype).view(1, h, 1)
    return pack_rows((tables * h + heads).reshape(s * h, k), lens.reshape(s * h, k))


def fold_cache(cache: torch.Tensor) -> torch.Tensor:
    """``(num_blocks, H, block_size, D)`` (any strides with the head stride dividing the block
    stride ``H`` times) -> the ``(num_blocks * H, 1, block_size, D)`` view of :func:`fold_heads`."""
    nb, h, bs, d = cache.shape
    sb, sh, st, sd = cache.stride()
    if sb != h * sh:
        raise ValueError(f"cache strides {cache.stride()} do not hold a block's heads one after another")
    return cache.as_strided((nb * h, 1, bs, d), (sh, sh, st, sd), cache.storage_offset())


def union_rows(
    tables: torch.Tensor, lens: torch.Tensor, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head selections ``(S, H, k)`` -> one row per request holding the union of its
    heads' blocks: ``(S, width)`` int32 block table (``width`` defaults to the widest
    union) and ``(S,)`` lengths."""
    if tables.dim() != 3 or tables.shape != lens.shape:
        raise ValueError(f"tables and lens must be equal (S, H, k) shapes, got {tuple(tables.shape)}")
    rows, row_lens = [], []
    for t, ln in zip(tables.flatten(1), lens.flatten(1)):
        used = ln > 0
        blocks, first = _unique_first(t[used])
        rows.append(blocks)
        row_lens.append(ln[used][first])
    w = max(int(r.numel()) for r in rows) if width is None else width
    if any(int(r.numel()) > w for r in rows):
        raise ValueError(f"a request's union of blocks exceeds the row width {w}")
    out_t = torch.zeros((len(rows), w), dtype=tables.dtype, device=tables.device)
    out_l = torch.zeros((len(rows), w), dtype=lens.dtype, device=lens.device)
    for i, (r, ln) in enumerate(zip(rows, row_lens)):
        out_t[i, : r.numel()] = r
        out_l[i, : r.numel()] = ln
    return pack_rows(out_t, out_l)


def _unique_first(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct values of ``x`` and the index of one occurrence of each."""
    vals, inverse = torch.unique(x, return_inverse=True)
    first = torch.full((vals.numel(),), x.numel(), dtype=torch.int64, device=x.device)
    first.scatter_reduce_(0, inverse, torch.arange(x.numel(), device=x.device), reduce="amin")
    return vals, first


def replace_rows(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    selections: dict[int, tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of a batch's ``block_table (B, W)`` and ``seq_lens (B,)`` in which each row
    ``i`` of ``selections`` (its per-head ``(H, k)`` blocks and lengths) reads the union of
    its heads' blocks (:func:`union_rows`); other rows are unchanged. The union is a subset
    of the row's own blocks, so it fits in ``W``."""
    bt, sl = block_table.clone(), seq_lens.clone()
    if not selections:
        return bt, sl
    rows = sorted(selections)
    tables = torch.stack([selections[i][0] for i in rows])
    lens = torch.stack([selections[i][1] for i in rows])
    new_t, new_l = union_rows(tables, lens, width=int(bt.shape[1]))
    idx = torch.tensor(rows, dtype=torch.int64, device=bt.device)
    bt.index_copy_(0, idx, new_t.to(bt.dtype))
    sl.index_copy_(0, idx, new_l.to(sl.dtype))
    return bt, sl


__all__ = ["fold_cache", "fold_heads", "pack_rows", "replace_rows", "union_rows"]
