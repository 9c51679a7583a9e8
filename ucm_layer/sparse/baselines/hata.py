"""Sign-hash codes with Hamming top-k (HATA; UCM's on-device variant).

Every key gets ``bits`` sign bits of random projections ``sign(R^T k)`` (``R`` fixed per
head, Gaussian, seeded); a query's code is ``sign(R^T q)``. The similarity of a key is the
number of agreeing bits (``bits - Hamming``); a block scores as its best key, the group as
its best head. Storage: ``bits / 8`` bytes per token (reported as ``bits * block_size / 32``
float32-equivalent numbers per block). Codes are held unpacked as int8-valued floats here
so the Hamming count is one matrix product; packing is a storage detail.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvfabric.settings import setting
from kvfabric.ucm_layer.sparse.scorer import ScorerOptions, TokenRowsScorer, block_view


@dataclass(frozen=True)
class HataOptions(ScorerOptions):
    """The ``hata`` plugin's scorer keys."""

    scorer: ClassVar[str] = "hata"
    bits: int = setting(128, lo=1, doc="sign bits per token")
    seed: int = setting(0, doc="seed of the random projections")


class HataScorer(TokenRowsScorer):
    name = "hata"
    combine = "max"
    options = HataOptions

    def __init__(self, num_kv_heads: int, head_dim: int, block_size: int, **options: Any) -> None:
        super().__init__(num_kv_heads, head_dim, block_size)
        o = HataOptions(**options)
        self.bits = o.bits
        self.seed = o.seed
        self._proj: torch.Tensor | None = None

    @property
    def numbers_per_block(self) -> float:
        return self.bits * self.block_size / 32.0

    @property
    def row_width(self) -> int:
        return self.bits

    def prepare(self, keys: torch.Tensor) -> None:
        g = torch.Generator().manual_seed(self.seed)
        proj = torch.randn((self.num_kv_heads, self.head_dim, self.bits), generator=g)
        self._proj = proj.to(device=keys.device, dtype=keys.dtype)

    def token_rows(self, keys: torch.Tensor) -> torch.Tensor:
        """The sign codes ``(H, n, bits)`` of ``keys`` (or queries), +-1."""
        if self._proj is None:
            raise ValueError("hata: no projections yet, call fit() first")
        y = torch.matmul(keys, self._proj)
        return torch.where(y >= 0, 1.0, -1.0).to(y.dtype)

    def block_scores(self, q: torch.Tensor) -> torch.Tensor:
        codes = self.rows()
        agree = torch.matmul(self.token_rows(q), codes.transpose(1, 2))  # (H, G, n) = 2*match - bits
        h, g, n = agree.shape
        per_block = block_view(agree.reshape(h * g, n, 1), self.block_size, float("-inf")).amax(dim=2)
        return per_block.reshape(h, g, -1)


__all__ = ["HataOptions", "HataScorer"]
