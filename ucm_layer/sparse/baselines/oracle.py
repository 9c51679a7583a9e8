"""Oracle: blocks ranked by their true attention mass (the best any block summary can do).

It keeps the keys themselves (a reference to the tensors given to ``fit``/``append`` is
*copied* into its own growing buffer), so its "summary" is the whole key cache.
"""

from __future__ import annotations

import math

import torch

from kvfabric.ucm_layer.sparse.scorer import TokenRowsScorer, block_view


class OracleScorer(TokenRowsScorer):
    name = "oracle"
    combine = "sum"

    @property
    def numbers_per_block(self) -> float:
        return float(self.head_dim * self.block_size)

    @property
    def row_width(self) -> int:
        return self.head_dim

    def token_rows(self, keys: torch.Tensor) -> torch.Tensor:
        return keys

    def block_scores(self, q: torch.Tensor) -> torch.Tensor:
        """``(H, G, nb)`` true attention mass of each block for each query head."""
        k = self.rows()
        p = torch.softmax(torch.matmul(q, k.transpose(1, 2)) / math.sqrt(self.head_dim), dim=-1)
        h, g, n = p.shape
        return block_view(p.reshape(h * g, n, 1), self.block_size, 0.0).sum(dim=2).reshape(h, g, -1)


__all__ = ["OracleScorer"]
