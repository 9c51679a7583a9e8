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

import enum
import functools
from typing import Any

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from kvfabric.ucm_layer.sparse.base import LayerKV
from kvfabric.ucm_layer.sparse.vllm.impl import LayerCall, SparseImplMixin
from kvfabric.ucm_layer.sparse.vllm.rewrite import fold_cache, fold_heads
from kvfabric.ucm_layer.sparse.vllm.runtime import LayerSelection


class KeyLayout(enum.Enum):
    """How vLLM's CPU cache writer lays out one (block, KV head)'s keys for an ISA."""

    ROWS = "rows"  # (block_size, D): a key per row, as the values are
    COLUMNS = "columns"  # (D, block_size): the ``vec`` kernels read keys transposed


@functools.cache
def key_layout(isa: str, head_size: int, block_size: int, dtype: torch.dtype) -> KeyLayout | None:
    """The layout ``ops.cpu_attn_reshape_and_cache`` writes keys in for ``isa``, found by
    writing one block of known keys to a scratch cache (None: neither layout, e.g. a
    packed one; the keys then cannot be read back as keys)."""
    cache = torch.zeros(1, 1, block_size, 2 * head_size, dtype=dtype)
    kc, vc = split_cache(cache)
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(block_size, 1, head_size, generator=gen).to(dtype)
    slots = torch.arange(block_size, dtype=torch.int64)
    ops.cpu_attn_reshape_and_cache(keys, torch.zeros_like(keys), kc, vc, slots, isa)
    block = kc[0, 0]
    if torch.equal(block, keys[:, 0]):
        return KeyLayout.ROWS
    if torch.equal(block.reshape(head_size, block_size), keys[:, 0].t()):
        return KeyLayout.COLUMNS
    return None


def key_rows(key_cache: torch.Tensor, layout: KeyLayout) -> torch.Tensor:
    """The split key cache (``split_cache``) as ``(num_blocks, H, block_size, D)`` keys,
    whatever the writer's ``layout`` (a view, no copy)."""
    if layout is KeyLayout.ROWS:
        return key_cache
    nb, h, bs, d = key_cache.shape
    return key_cache.view(nb, h, d, bs).transpose(2, 3)


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
    md = scheduler_metadata(
        query, int(key_cache.shape[1]), seq_lens, query_start_loc, isa, causal, kv_cache_dtype
    )
    run_kernel(
        query,
        key_cache,
        value_cache,
        output,
        query_start_loc,
        seq_lens,
        block_table,
        scale,
        md,
        causal=causal,
        softcap=softcap,
        k_scale=k_scale,
        v_scale=v_scale,
        kv_cache_dtype=kv_cache_dtype,
    )


def fold_query(query: torch.Tensor, h: int) -> torch.Tensor:
    """``(S, Hq, D)`` decode queries -> ``(S * H, G, D)``: sequence ``s * H + h`` is request
    ``s``'s KV head ``h`` with its ``G`` query heads (a view)."""
    s, hq, d = query.shape
    return query.reshape(s * h, hq // h, d)


def fold_physical(physical: torch.Tensor) -> torch.Tensor:
    """Per-head physical blocks ``(S, H, k)`` -> the folded one-head cache's block table
    ``(S * H, k)`` int32 (block ``b`` of head ``h`` is ``b * H + h``), order kept."""
    s, h, k = physical.shape
    heads = torch.arange(h, device=physical.device, dtype=physical.dtype).view(1, h, 1)
    return (physical * h + heads).reshape(s * h, k).to(torch.int32)


def sparse_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    isa: str,
    kernel_lens: torch.Tensor | None = None,
    memo: dict[Any, Any] | None = None,
    **kernel: Any,
) -> torch.Tensor:
    """Decode attention of ``S`` requests, one token each: ``query (S, Hq, D)``, per-KV-head
    physical blocks ``tables`` and valid lengths ``lens`` ``(S, H, k)`` (length 0: unused
    entry), caches ``(num_blocks, H, block_size, D)`` views. Returns ``(S, Hq, D)``: every
    query head attends to exactly the tokens of its KV head's selected blocks.

    ``kernel_lens (S * H,)`` int32: the folded sequences' lengths when every head's entries
    are full blocks with the partial one last (then ``lens`` is not read and no sort is
    needed); ``memo``: a per-step dict where the kernel's scheduler metadata is kept for
    the next call with the same ``kernel_lens`` object (the layers of one step)."""
    s, hq, d = query.shape
    h = int(key_cache.shape[1])
    if tables.shape[:2] != (s, h):
        raise ValueError(f"tables {tuple(tables.shape)} must be (requests={s}, kv heads={h}, k)")
    if kernel_lens is not None:
        block_table, seq_lens = fold_physical(tables), kernel_lens
    else:
        block_table, seq_lens = fold_heads(tables, lens)
    q = fold_query(query, h)
    out = torch.empty_like(q)
    key = ("sparse", id(kernel_lens), s * h, hq // h, d, q.dtype)
    md = memo.get(key) if memo is not None and kernel_lens is not None else None
    if md is None:
        qsl = torch.arange(s * h + 1, dtype=torch.int32, device=query.device)
        md = (qsl, scheduler_metadata(q, 1, seq_lens, qsl, isa, True, kernel.get("kv_cache_dtype", "auto")))
        if memo is not None and kernel_lens is not None:
            memo[key] = md
    run_kernel(
        q,
        fold_cache(key_cache),
        fold_cache(value_cache),
        out,
        md[0],
        seq_lens,
        block_table,
        scale,
        md[1],
        **kernel,
    )
    return out.view(s, hq, d)


def scheduler_metadata(
    query: torch.Tensor,
    num_kv_heads: int,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    isa: str,
    causal: bool,
    kv_cache_dtype: str = "auto",
) -> torch.Tensor:
    """vLLM's CPU scheduler metadata for these rows (depends on the lengths and shapes only,
    so the layers of one step can share it)."""
    return ops.cpu_attn_get_scheduler_metadata(
        int(seq_lens.numel()),
        int(query.shape[1]),
        num_kv_heads,
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


def run_kernel(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    output: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    md: torch.Tensor,
    causal: bool = True,
    softcap: float = 0.0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    kv_cache_dtype: str = "auto",
) -> None:
    """vLLM's CPU kernel with precomputed scheduler metadata ``md``."""
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
    _key_layout: KeyLayout | None = None  # found at the first forward (the ISA is the builder's)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._attach(sliding_window=self.sliding_window != -1)

    def _cache_views(self, kv_cache: torch.Tensor, layer: Any) -> LayerKV:
        """The keys as keys: the ``vec`` kernels' writer stores a block's keys transposed
        (``key_layout``); a layout that is neither rows nor columns is refused."""
        k, v = split_cache(kv_cache)
        layout = self._key_layout
        if layout is None:
            layout = key_layout(layer.isa, self.head_size, int(kv_cache.shape[2]), kv_cache.dtype)
        if layout is None:
            raise RuntimeError(
                f"kvfabric sparse: vLLM's CPU attention ISA {layer.isa!r} stores keys in a layout "
                "kvfabric cannot read back (neither rows nor columns per block); run without "
                "kvfabric_sparse on this machine"
            )
        self._key_layout = layout
        return LayerKV(key_rows(k, layout).transpose(0, 1), v.transpose(0, 1))

    def _num_blocks(self, kv_cache: torch.Tensor) -> int:
        return int(kv_cache.shape[0])

    def _forward_sparse(self, call: LayerCall, chosen: LayerSelection) -> None:
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
        sparse: LayerSelection,
    ) -> None:
        """Sparse rows through :func:`sparse_decode`, the other rows through the kernel over
        their own block-table rows; both write into ``output``. What depends only on the
        step (the other rows' tables and the kernels' scheduler metadata) is kept in the
        step's memo ``sparse.cache``."""
        n = query.shape[0]
        out = output[:n].view(n, self.num_heads, self.head_size)
        kernel = dict(
            k_scale=layer._k_scale_float, v_scale=layer._v_scale_float, kv_cache_dtype=self.kv_cache_dtype
        )
        s = len(sparse.rows)
        tok = sparse.token_index
        q = query[:s] if sparse.identity else query.index_select(0, tok)
        res = sparse_decode(
            q,
            key_cache,
            value_cache,
            sparse.physical,
            sparse.lens,
            self.scale,
            layer.isa,
            kernel_lens=sparse.kernel_lens,
            memo=sparse.cache,
            **kernel,
        )
        if sparse.identity:
            out[:s] = res
        else:
            out.index_copy_(0, tok, res)
        key = ("dense", sparse.rows)
        dense = sparse.cache.get(key)
        if dense is None:
            dense = sparse.cache[key] = self._dense_rows(query, md, set(sparse.rows), layer.isa)
        if dense == ():
            return
        dtok, sub_qsl, seq_lens, table, sched = dense
        sub_out = torch.empty((dtok.numel(), self.num_heads, self.head_size), dtype=query.dtype)
        run_kernel(
            query.index_select(0, dtok),
            key_cache,
            value_cache,
            sub_out,
            sub_qsl,
            seq_lens,
            table,
            self.scale,
            sched,
            causal=md.causal,
            softcap=self.logits_soft_cap,
            **kernel,
        )
        out.index_copy_(0, dtok, sub_out)

    def _dense_rows(self, query: torch.Tensor, md: Any, sparse: set[int], isa: str) -> tuple[Any, ...]:
        """The step's rows that are not sparse: their tokens, query_start_loc, lengths, block
        table rows and scheduler metadata (``()``: none)."""
        qsl = md.query_start_loc.tolist()
        dense = [i for i in range(len(qsl) - 1) if i not in sparse and qsl[i + 1] > qsl[i]]
        if not dense:
            return ()
        dtok = torch.cat([torch.arange(qsl[i], qsl[i + 1]) for i in dense])
        counts = torch.tensor([qsl[i + 1] - qsl[i] for i in dense], dtype=torch.int32)
        sub_qsl = torch.zeros(len(dense) + 1, dtype=torch.int32)
        torch.cumsum(counts, 0, out=sub_qsl[1:])
        rows_t = torch.tensor(dense, dtype=torch.int64)
        seq_lens = md.seq_lens.index_select(0, rows_t)
        table = md.block_table.index_select(0, rows_t)
        sched = scheduler_metadata(
            query.view(query.shape[0], self.num_heads, self.head_size),
            self.num_kv_heads,
            seq_lens,
            sub_qsl,
            isa,
            md.causal,
            self.kv_cache_dtype,
        )
        return dtok, sub_qsl, seq_lens, table, sched


class KVFabricCPUBackend(CPUAttentionBackend):
    """vLLM's CPU backend whose impl runs kvfabric's sparse decode when configured."""

    @staticmethod
    def get_impl_cls() -> type[KVFabricCPUSparseImpl]:
        return KVFabricCPUSparseImpl


__all__ = [
    "KVFabricCPUBackend",
    "KVFabricCPUSparseImpl",
    "fold_physical",
    "paged_attention",
    "sparse_decode",
    "split_cache",
]
