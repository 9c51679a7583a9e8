"""Quest: element-wise min/max of the keys of each page (block), no projection.

``sum_i max(q_i M_i, q_i m_i)`` bounds ``q.k`` for every key of the block; ``2D`` numbers
per block. It is GSA's bound with the identity basis and no residual term.
"""

from __future__ import annotations

import torch

from kvfabric.ucm_layer.sparse.scorer import RowMaxScorer


class QuestScorer(RowMaxScorer):
    name = "quest"
    combine = "softmax"

    @property
    def row_width(self) -> int:
        return 2 * self.head_dim

    def key_rows(self, keys: torch.Tensor) -> torch.Tensor:
        return torch.cat([keys, -keys], dim=-1)  # [max k, max -k] = [M, -m]

    def query_weights(self, q: torch.Tensor) -> torch.Tensor:
        return torch.cat([q.clamp(min=0), (-q).clamp(min=0)], dim=-1)


__all__ = ["QuestScorer"]
