"""What the platform impls of the sparse backend share (``cpu``, ``cuda``).

:class:`SparseImplMixin` goes before the platform's impl class in the bases. Contract:

``__new__``: with no sparse algorithm configured, returns the platform's own impl (built
with the same arguments), so the engine runs the stock object; otherwise an instance of
the subclass. ``__init__`` (the subclass's, after the platform's): calls
:meth:`_attach` with the platform's own features that keep this layer dense, which builds (or joins) the
worker's :class:`SparseRuntime`. ``forward`` runs the runtime's hooks around either the
stock ``forward`` (no request sparse in this layer) or the subclass's
:meth:`_forward_sparse` (the sparse rows' per-head selections given); the subclass also
gives :meth:`_cache_views`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from kvfabric.ucm_layer.sparse.base import LayerKV, ModelSpec
from kvfabric.ucm_layer.sparse.vllm.config import SparseBackendConfig, from_vllm_config
from kvfabric.ucm_layer.sparse.vllm.runtime import LayerSelection, SparseRuntime, layer_index, runtime_for

log = logging.getLogger("kvfabric.sparse")


@dataclass(frozen=True)
class LayerCall:
    """The arguments of one layer's ``forward`` as vLLM passed them (tensors are vLLM's)."""

    layer: Any
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: torch.Tensor
    metadata: Any
    output: torch.Tensor


class SparseImplMixin:
    """Sparse decode around a platform attention impl (see the module docstring)."""

    #: the platform impl class this mixin extends (set by each subclass)
    stock_impl: type

    _sparse_config: SparseBackendConfig
    _runtime: SparseRuntime | None
    _layer: int | None

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        from vllm.config import get_current_vllm_config

        config = from_vllm_config(get_current_vllm_config())
        base = cls.stock_impl
        if not config.enabled:
            impl = base.__new__(base, *args, **kwargs)
            impl.__init__(*args, **kwargs)
            return impl
        self = base.__new__(cls, *args, **kwargs)
        self._sparse_config = config
        return self

    def _attach(self, **platform_dense: bool) -> None:
        """Join the worker's runtime (from the impl's ``num_heads``, ``num_kv_heads``,
        ``head_size``), unless a feature keeps this layer dense: those every vLLM impl
        names the same way, and ``platform_dense`` (feature name -> present)."""
        from vllm.config import get_current_vllm_config
        from vllm.v1.attention.backend import AttentionType

        impl: Any = self
        self._runtime, self._layer = None, None
        dense_because = {
            "non-decoder attention": impl.attn_type != AttentionType.DECODER,
            "ALiBi": impl.alibi_slopes is not None,
            "attention sinks": impl.sinks is not None,
            "logits soft cap": bool(impl.logits_soft_cap),
            "KV sharing": impl.kv_sharing_target_layer_name is not None,
            **platform_dense,
        }
        reasons = [what.replace("_", " ") for what, bad in dense_because.items() if bad]
        if reasons:
            log.warning("kvfabric sparse: a layer with %s stays dense", ", ".join(reasons))
            return
        vc = get_current_vllm_config()
        spec = ModelSpec(
            num_layers=vc.model_config.get_total_num_hidden_layers(),
            num_q_heads=impl.num_heads,
            num_kv_heads=impl.num_kv_heads,
            head_dim=impl.head_size,
            block_size=vc.cache_config.block_size,
        )
        self._runtime = runtime_for(self._sparse_config, spec, rank=vc.parallel_config.rank)

    # ------------------------------------------------------------------ per platform
    def _cache_views(self, kv_cache: torch.Tensor, layer: Any) -> LayerKV:
        """The layer's cache as ``(H, num_blocks, block_size, D)`` views of keys and values
        as vectors (for the plugin; whatever layout the platform's writer uses)."""
        raise NotImplementedError

    def _num_blocks(self, kv_cache: torch.Tensor) -> int:
        """Physical blocks of the layer's cache."""
        raise NotImplementedError

    def _forward_sparse(self, call: LayerCall, chosen: LayerSelection) -> None:
        """Attention of ``call``'s batch with rows ``chosen.rows`` reading their selections,
        written into ``call.output``."""
        raise NotImplementedError

    # ------------------------------------------------------------------ vLLM's call
    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The runtime's hooks around the stock ``forward`` or :meth:`_forward_sparse`."""
        md, rt = attn_metadata, self._runtime
        plan = None
        if (
            rt is not None
            and md is not None
            and output_scale is None
            and output_block_scale is None
            and getattr(md, "dynamic_causal", None) is None
        ):
            plan = rt.plan(md, md.block_table, md.seq_lens, md.query_start_loc, self._num_blocks(kv_cache))
        if plan is None:
            return self.stock_impl.forward(
                self, layer, query, key, value, kv_cache, md, output, output_scale, output_block_scale
            )
        if self._layer is None:
            self._layer = layer_index(layer.layer_name)
        n = md.num_actual_tokens
        q, k, v = query[:n], key[:n], value[:n]
        cache = self._cache_views(kv_cache, layer)
        chosen = rt.layer_begin(plan, self._layer, (q, k, v), cache)
        if chosen is not None:
            self._forward_sparse(LayerCall(layer, query, key, value, kv_cache, md, output), chosen)
        else:
            self.stock_impl.forward(self, layer, query, key, value, kv_cache, md, output)
        rt.layer_end(plan, self._layer, output[:n].view(n, q.shape[1], -1), cache)
        return output


__all__ = ["LayerCall", "SparseImplMixin"]
