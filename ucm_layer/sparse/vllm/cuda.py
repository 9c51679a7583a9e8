"""The ``CUSTOM`` backend for NVIDIA GPUs (``--attention-backend CUSTOM``): vLLM's
FlashAttention backend with block-sparse decode.

:class:`KVFabricFlashBackend` is vLLM's ``FlashAttentionBackend`` (builder, cache layout
``(2, num_blocks, block_size, H, D)``, cache update) whose impl is vLLM's
``FlashAttentionImpl`` unless a sparse algorithm is configured. FlashAttention's block
holds the KV heads interleaved token by token, so a (block, head) pair is not a block of
any view and the per-head selection cannot be folded into rows as on CPU: each sparse
request reads the union of its KV heads' selected blocks (``rewrite.replace_rows``), the
other rows unchanged, through the stock ``forward`` on a copy of the metadata with the
rewritten ``block_table`` / ``seq_lens`` (and no precomputed FA3 scheduler metadata, which
was sized for the dense lengths). The module imports vLLM's FlashAttention backend, which
imports without a GPU; the kernel needs one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionImpl

from kvfabric.ucm_layer.sparse.base import LayerKV
from kvfabric.ucm_layer.sparse.vllm.impl import LayerCall, SparseImplMixin
from kvfabric.ucm_layer.sparse.vllm.rewrite import replace_rows
from kvfabric.ucm_layer.sparse.vllm.runtime import LayerSelection


class KVFabricFlashSparseImpl(SparseImplMixin, FlashAttentionImpl):
    """vLLM's FlashAttention impl with block-sparse decode (see the module docstring)."""

    stock_impl = FlashAttentionImpl

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._attach(
            sliding_window=tuple(self.sliding_window) != (-1, -1),
            decode_context_parallelism=self.dcp_world_size > 1,
        )

    def _cache_views(self, kv_cache: torch.Tensor, layer: Any) -> LayerKV:
        k, v = kv_cache.unbind(0)  # (num_blocks, block_size, H, D)
        return LayerKV(k.permute(2, 0, 1, 3), v.permute(2, 0, 1, 3))

    def _num_blocks(self, kv_cache: torch.Tensor) -> int:
        return int(kv_cache.shape[1])

    def _forward_sparse(self, call: LayerCall, chosen: LayerSelection) -> None:
        md = call.metadata
        rows = {r: (chosen.physical[j], chosen.lens[j]) for j, r in enumerate(chosen.rows)}
        bt, sl = replace_rows(md.block_table, md.seq_lens, rows)
        sparse_md = dataclasses.replace(md, block_table=bt, seq_lens=sl, scheduler_metadata=None)
        FlashAttentionImpl.forward(
            self, call.layer, call.query, call.key, call.value, call.kv_cache, sparse_md, call.output
        )


class KVFabricFlashBackend(FlashAttentionBackend):
    """vLLM's FlashAttention backend whose impl runs kvfabric's sparse decode when configured."""

    @staticmethod
    def get_impl_cls() -> type[KVFabricFlashSparseImpl]:
        return KVFabricFlashSparseImpl


__all__ = ["KVFabricFlashBackend", "KVFabricFlashSparseImpl"]
