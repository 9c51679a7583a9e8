"""The baselines as plugins behind the same hooks as GSA (registered in ``sparse.base``)."""

from __future__ import annotations

from kvfabric.ucm_layer.sparse.blocksparse import BlockSparseAttention


class Quest(BlockSparseAttention):
    """Quest: per-block element-wise min/max of the keys (2 x head_dim numbers)."""

    name = "quest"
    scorer_name = "quest"


class MeanKey(BlockSparseAttention):
    """UCM's offload GSA representation: the mean key per block."""

    name = "meankey"
    scorer_name = "meankey"


class Hata(BlockSparseAttention):
    """Sign-hash codes with Hamming top-k (``bits`` option, default 128)."""

    name = "hata"
    scorer_name = "hata"


class Oracle(BlockSparseAttention):
    """Top-k blocks by true attention mass (an upper reference, not a deployable method)."""

    name = "oracle"
    scorer_name = "oracle"


__all__ = ["Hata", "MeanKey", "Oracle", "Quest"]
