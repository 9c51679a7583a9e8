"""Oracle: blocks ranked by their true attention mass (the best any block summary can do).

It keeps the keys themselves (a reference to the tensors given to ``fit``/``append`` is
*copied* into its own growing buffer), so its "summary" is the whole key cache.
"""

from __future__ import annotations

import math

import torch

from kvfabric.ucm_layer.sparse.scorer import BlockScorer, GrowingRows, block_view


class OracleScorer(BlockScorer):
    name = "oracle"
    combine = "sum"

    def __init__(self, num_kv_heads: int, head_dim: int, block_size: int) -> None:
        super().__init__(num_kv_heads, head_dim, block_size)
        self._keys: GrowingRows | None = None

    @property
    def numbers_per_block(self) -> float:
        return float(self.head_dim * self.block_size)

    def _fit(self, keys: torch.Tensor) -> None:
        self._keys = GrowingRows(keys.shape[0], keys.shape[2], keys, capacity=max(1024, 2 * keys.shape[1]))
        self._keys.ensure(keys.shape[1])[:, : keys.shape[1]] = keys

    def _append(self, keys: torch.Tensor, start: int) -> None:
        if self._keys is None:
            raise ValueError("oracle: append() before fit()")
        self._keys.ensure(start + keys.shape[1])[:, start : start + keys.shape[1]] = keys

    def block_scores(self, q: torch.Tensor) -> torch.Tensor:
        """``(H, G, nb)`` true attention mass of each block for each query head."""
        if self._keys is None:
            raise ValueError("oracle: no keys yet, call fit() first")
        k = self._keys.data[:, : self.num_tokens]
        p = torch.softmax(torch.matmul(q, k.transpose(1, 2)) / math.sqrt(self.head_dim), dim=-1)
        h, g, n = p.shape
        return block_view(p.reshape(h * g, n, 1), self.block_size, 0.0).sum(dim=2).reshape(h, g, -1)


__all__ = ["OracleScorer"]
