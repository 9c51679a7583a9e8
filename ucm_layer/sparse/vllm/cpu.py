"""The ``CPU_ATTN`` slot's override: vLLM's CPU backend with block-sparse decode.

:class:`KVFabricCPUBackend` is vLLM's ``CPUAttentionBackend`` (same name, builder, cache
layout and cache update) whose impl, :class:`KVFabricCPUSparseImpl`, is built only when a
sparse algorithm is configured (``config``): otherwise constructing it returns vLLM's own
``CPUAttentionBackendImpl``, so an engine without sparse attention runs the stock objects.

Per layer forward (the step's keys/values are already in the cache, written by the
inherited ``do_kv_cache_update``): the :class:`SparseRuntime` decides per request; with no
request in sparse mode the stock ``forward`` runs untouched (prefill, short contexts,
layers the switch keeps dense: identical results). Otherwise the sparse requests (decode,
one token each) run :func:`sparse_decode` (per-(request, KV head) selection through the
folded cache view of ``rewrite``) and the others the same kernel over their own rows.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from kvfabric.ucm_layer.sparse.base import LayerKV
from kvfabric.ucm_layer.sparse.vllm.impl import LayerCall, Selections, SparseImplMixin
from kvfabric.ucm_layer.sparse.vllm.rewrite import fold_cache, fold_heads


def split_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM CPU's ``(num_blocks, H, block_size, 2 * D)`` cache -> key and value views
    ``(num_blocks, H, block_size, D)`` (as the stock impl slices them)."""
    nb, h, bs, _ = kv_cache.size()
    k, v = kv_cache.view((nb, h, bs * 2, -1)).chunk(2, dim=2)
    return k, v


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    output: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    isa: str,
    causal: bool = True,
    softcap: float = 0.0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    kv_cache_dtype: str = "auto",
) -> None:
    """vLLM's CPU kernel over ``block_table (R, n)`` / ``seq_lens (R,)`` (int32), writing
    ``output`` (shaped like ``query``: ``(tokens, heads, D)``); the scheduler metadata is
    built here for these rows (heads from ``query``, KV heads from ``key_cache``)."""
    md = ops.cpu_attn_get_scheduler_metadata(
        int(seq_lens.numel()),
        int(query.shape[1]),
        int(key_cache.shape[1]),
        int(query.shape[2]),
        seq_lens,
        query.dtype,
        query_start_loc,
        causal,
        -1,  # no sliding window
        isa,
        envs.VLLM_CPU_ATTN_SPLIT_KV,
        kv_cache_dtype=kv_cache_dtype,
    )
    ops.cpu_attention_with_kv_cache(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        output=output,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        scale=scale,
        causal=causal,
        alibi_slopes=None,
        sliding_window=-1,
        block_table=block_table,
        softcap=softcap,
        scheduler_metadata=md,
        s_aux=None,
        k_scale=k_scale,
        v_scale=v_scale,
        kv_cache_dtype=kv_cache_dtype,
    )


def sparse_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    isa: str,
    **kernel: Any,
) -> torch.Tensor:
    """Decode attention of ``S`` requests, one token each: ``query (S, Hq, D)``, per-KV-head
    physical blocks ``tables`` and valid lengths ``lens`` ``(S, H, k)`` (length 0: unused
    entry), caches ``(num_blocks, H, block_size, D)`` views. Returns ``(S, Hq, D)``: every
    query head attends to exactly the tokens of its KV head's selected blocks."""
    s, hq, d = query.shape
    h = int(key_cache.shape[1])
    if tables.shape[:2] != (s, h):
        raise ValueError(f"tables {tuple(tables.shape)} must be (requests={s}, kv heads={h}, k)")
    block_table, seq_lens = fold_heads(tables, lens)
    q = query.reshape(s * h, hq // h, d)
    out = torch.empty_like(q)
    qsl = torch.arange(s * h + 1, dtype=torch.int32, device=query.device)
    paged_attention(
        q,
        fold_cache(key_cache),
        fold_cache(value_cache),
        out,
        qsl,
        seq_lens,
        block_table,
        scale,
        isa,
        **kernel,
    )
    return out.view(s, hq, d)


def pad_selections(
    selections: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(H, k_i)`` tables/lengths of several requests -> ``(S, H, max k)``, padded with
    unused (length 0) entries."""
    k = max(int(t.shape[-1]) for t, _ in selections)
    tables = torch.stack([torch.nn.functional.pad(t, (0, k - t.shape[-1])) for t, _ in selections])
    lens = torch.stack([torch.nn.functional.pad(ln, (0, k - ln.shape[-1])) for _, ln in selections])
    return tables, lens


class KVFabricCPUSparseImpl(SparseImplMixin, CPUAttentionBackendImpl):
    """vLLM's CPU impl with block-sparse decode (see the module docstring)."""

    stock_impl = CPUAttentionBackendImpl

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._attach(sliding_window=self.sliding_window != -1)

    def _cache_views(self, kv_cache: torch.Tensor) -> LayerKV:
        k, v = split_cache(kv_cache)
        return LayerKV(k.transpose(0, 1), v.transpose(0, 1))

    def _forward_sparse(self, call: LayerCall, chosen: Selections) -> None:
        k, v = split_cache(call.kv_cache)
        md = call.metadata
        self._forward_split(call.layer, call.query[: md.num_actual_tokens], k, v, md, call.output, chosen)

    def _forward_split(
        self,
        layer: Any,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        md: Any,
        output: torch.Tensor,
        sparse: Selections,
    ) -> None:
        """Sparse rows through :func:`sparse_decode`, the other rows through the kernel over
        their own block-table rows; both write into ``output``."""
        n = query.shape[0]
        out = output[:n].view(n, self.num_heads, self.head_size)
        qsl = md.query_start_loc.tolist()
        kernel = dict(
            k_scale=layer._k_scale_float, v_scale=layer._v_scale_float, kv_cache_dtype=self.kv_cache_dtype
        )
        rows = sorted(sparse)
        tok = torch.tensor([qsl[i] for i in rows], dtype=torch.int64)
        tables, lens = pad_selections([sparse[i] for i in rows])
        res = sparse_decode(
            query.index_select(0, tok), key_cache, value_cache, tables, lens, self.scale, layer.isa, **kernel
        )
        out.index_copy_(0, tok, res)
        dense = [i for i in range(len(qsl) - 1) if i not in sparse and qsl[i + 1] > qsl[i]]
        if not dense:
            return
        dtok = torch.cat([torch.arange(qsl[i], qsl[i + 1]) for i in dense])
        counts = torch.tensor([qsl[i + 1] - qsl[i] for i in dense], dtype=torch.int32)
        sub_qsl = torch.zeros(len(dense) + 1, dtype=torch.int32)
        torch.cumsum(counts, 0, out=sub_qsl[1:])
        rows_t = torch.tensor(dense, dtype=torch.int64)
        sub_out = torch.empty((dtok.numel(), self.num_heads, self.head_size), dtype=query.dtype)
        paged_attention(
            query.index_select(0, dtok),
            key_cache,
            value_cache,
            sub_out,
            sub_qsl,
            md.seq_lens.index_select(0, rows_t),
            md.block_table.index_select(0, rows_t),
            self.scale,
            layer.isa,
            causal=md.causal,
            softcap=self.logits_soft_cap,
            **kernel,
        )
        out.index_copy_(0, dtok, sub_out)


class KVFabricCPUBackend(CPUAttentionBackend):
    """vLLM's CPU backend whose impl runs kvfabric's sparse decode when configured."""

    @staticmethod
    def get_impl_cls() -> type[KVFabricCPUSparseImpl]:
        return KVFabricCPUSparseImpl


__all__ = ["KVFabricCPUBackend", "KVFabricCPUSparseImpl", "paged_attention", "sparse_decode", "split_cache"]
