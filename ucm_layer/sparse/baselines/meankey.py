"""UCM's offload GSA representation: the mean key of each block (``D`` numbers).

The score ``q . mean(k)`` is the block's average logit: a single spike inside a block of
ordinary keys is averaged away, which is what the bound-based summaries avoid.
"""

from __future__ import annotations

import torch

from kvfabric.ucm_layer.sparse.scorer import BlockScorer, GrowingRows, block_view


class MeanKeyScorer(BlockScorer):
    name = "meankey"
    combine = "softmax"

    def __init__(self, num_kv_heads: int, head_dim: int, block_size: int) -> None:
        super().__init__(num_kv_heads, head_dim, block_size)
        self._sums: GrowingRows | None = None

    @property
    def numbers_per_block(self) -> float:
        return float(self.head_dim)

    def _fit(self, keys: torch.Tensor) -> None:
        h, n, d = keys.shape
        nb = -(-n // self.block_size)
        self._sums = GrowingRows(h, d, keys, capacity=max(64, 2 * nb))
        out = self._sums.ensure(nb)
        out[:, :nb] = block_view(keys, self.block_size, 0.0).sum(dim=2)

    def _append(self, keys: torch.Tensor, start: int) -> None:
        if self._sums is None:
            raise ValueError("meankey: append() before fit()")
        n = keys.shape[1]
        bs = self.block_size
        b0, b1 = start // bs, (start + n - 1) // bs
        out = self._sums.ensure(b1 + 1)
        idx = ((torch.arange(n, device=keys.device) + start) // bs).view(1, n, 1).expand_as(keys)
        fresh_from = b0 + (1 if start % bs else 0)
        out[:, fresh_from : b1 + 1] = 0
        out.scatter_add_(1, idx, keys)

    def means(self) -> torch.Tensor:
        if self._sums is None:
            raise ValueError("meankey: no summaries yet, call fit() first")
        nb = self.num_blocks
        counts = torch.full((nb,), float(self.block_size), device=self._sums.data.device)
        counts[-1] = self.num_tokens - (nb - 1) * self.block_size
        return self._sums.data[:, :nb] / counts.view(1, nb, 1)

    def block_scores(self, q: torch.Tensor) -> torch.Tensor:
        return torch.matmul(q, self.means().transpose(1, 2))


__all__ = ["MeanKeyScorer"]
