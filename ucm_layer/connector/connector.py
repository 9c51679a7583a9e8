"""``KVFabricConnector``: kvfabric as a vLLM ``KVConnectorBase_V1``, both roles.

vLLM (CUDA), vLLM-Ascend and the CPU build load it by configuration, with no patches::

    --kv-transfer-config '{"kv_connector": "KVFabricConnector",
                           "kv_connector_module_path": "kvfabric.ucm_layer.connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"store": "cache|posix"}}'

or by name alone once the ``vllm.general_plugins`` entry point registered it (see
``plugin.py``). This module is a thin adapter: it reads vLLM's objects through
``compat.py`` and hands plain values to :class:`SchedulerSide` (scheduler role) and
:class:`WorkerSide` (worker role); the step plan travels inside
:class:`KVFabricMetadata`. Block ids come from vLLM's own chained
``request.block_hashes`` re-keyed by a fingerprint of the model, the KV cache spec and
the physical KV layout, so two configurations never share a block. Both roles derive
the layout from vLLM's configuration (``compat.expected_kv_geometry``); the worker
checks, when vLLM hands it the KV tensors, that they are laid out that way and refuses
to start if not. Pipeline parallelism is refused at start-up (``check_engine``).

Hybrid models (several KV cache groups: sliding-window and full attention layers) keep
vLLM's hybrid KV cache manager: the connector is ``SupportsHMA``
(``request_finished_all_groups``), each group's blocks are stored under their own ids
(``hashing.tag(ids, rank, group)``), loads are asynchronous and fail per request
(``failed_recving`` of ``get_transfer_results``), never per block. Layer-wise transfers,
groups of other kinds (Mamba, chunked local attention) or other block sizes are refused.

Observability through vLLM's own hooks: counters in vLLM's connector stats and on its
``/metrics`` (``metrics.py``, ``prom.py``); with vLLM's KV events on
(``kv_events_config``), ``BlockStored`` for every block the store took, with its tier
(``events.py``: the workers report their dumps through
``get_kv_connector_kv_cache_events``, the scheduler emits from ``take_events``); with
tracing on, a root span per request and its children across both roles' processes
(``tracing.py``).
"""

from __future__ import annotations

import json
import logging
import weakref
from typing import Any

from kvfabric.platform.base import Platform
from kvfabric.platform.stream import Event
from kvfabric.ucm_layer import hashing
from kvfabric.ucm_layer.connector import compat, devices, events, metrics, stores
from kvfabric.ucm_layer.connector.config import ConnectorConfig, load_config
from kvfabric.ucm_layer.connector.plan import StepPlan
from kvfabric.ucm_layer.connector.scheduler import SchedulerSide
from kvfabric.ucm_layer.connector.tracing import Tracer
from kvfabric.ucm_layer.connector.worker import WorkerSide
from kvfabric.ucm_layer.kv_layout import layout_from_tensors
from kvfabric.ucm_layer.store.base import StoreLayout

log = logging.getLogger("kvfabric.connector")

_instances: weakref.WeakSet[KVFabricConnector] = weakref.WeakSet()


def instances() -> list[KVFabricConnector]:
    """Live connectors of this process (for tests, the demo and benchmarks)."""
    return list(_instances)


class KVFabricMetadata(compat.KVConnectorMetadata):
    """The step plan, from the scheduler role to the workers."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


if compat.KVConnectorStats is not None:

    class KVFabricStats(compat.KVConnectorStats):  # type: ignore[misc,valid-type]
        """kvfabric counters in vLLM's connector stats (see ``metrics.py``)."""

        def __init__(self, data: dict[str, Any] | None = None) -> None:
            super().__init__(data=data if data is not None else metrics.empty())

        def reset(self) -> None:
            self.data = metrics.empty()

        def aggregate(self, other: Any) -> KVFabricStats:
            return KVFabricStats(metrics.merge(self.data, getattr(other, "data", {}) or {}))

        def reduce(self) -> dict[str, int | float]:
            return metrics.reduce(self.data)

        def is_empty(self) -> bool:
            return metrics.is_empty(self.data)

else:  # pragma: no cover - vLLM without the stats API
    KVFabricStats = None  # type: ignore[assignment,misc]


if compat.KVConnectorKVEvents is not None:

    class KVFabricKVEvents(compat.KVConnectorKVEvents):  # type: ignore[misc,valid-type]
        """The workers' dump reports (``events.DumpReport``) on their way to the scheduler.

        vLLM moves it from each worker's ``get_kv_connector_kv_cache_events`` into the
        step's ``KVConnectorOutput`` (gathering the ranks' into the first one with
        ``add_events`` / ``increment_workers``); the scheduler role reads it in
        ``update_connector_output`` and publishes ``BlockStored`` events from
        ``take_events``. It holds reports, not vLLM events: nothing publishes it as is."""

        def __init__(self, reports: list[events.DumpReport] | None = None, workers: int = 1) -> None:
            self.reports: list[events.DumpReport] = list(reports or ())
            self.workers = workers

        def add_events(self, items: list[Any]) -> None:
            self.reports.extend(items)

        def aggregate(self) -> KVFabricKVEvents:
            return self  # the scheduler counts the ranks of each dump itself (events.py)

        def increment_workers(self, count: int = 1) -> None:
            self.workers += count

        def get_all_events(self) -> list[Any]:
            return list(self.reports)

        def get_number_of_workers(self) -> int:
            return self.workers

        def clear_events(self) -> None:
            self.reports = []
            self.workers = 1

else:  # pragma: no cover - vLLM without connector KV events
    KVFabricKVEvents = None  # type: ignore[assignment,misc]


def _pipeline_write(cfg: ConnectorConfig) -> str:
    """The pipeline's write mode (``pipeline.write`` of ``store_options``, flat or nested)."""
    opts = cfg.store_options
    nested = opts.get("pipeline")
    value = opts.get("pipeline.write") or (nested.get("write") if isinstance(nested, dict) else None)
    return str(value or "through")


def check_engine(info: compat.EngineInfo) -> None:
    """Refuse, at start-up and with the fix, the engine configurations kvfabric cannot serve."""
    if info.pp_size > 1:
        raise ValueError(
            f"kvfabric does not support pipeline parallelism (pipeline_parallel_size="
            f"{info.pp_size}): each stage holds other layers of a block, and block ids are per "
            "tensor-parallel rank only. Run with pipeline_parallel_size=1 (tensor parallelism "
            "is supported) or without kvfabric"
        )
    if not info.single_group and len(info.group_windows) < 2:
        raise ValueError(
            "kvfabric supports models with one KV cache group, or several of full and "
            "sliding-window attention with the engine's block size; this model has several "
            f"({info.group_problem or 'of kinds it cannot tell'}): run it with "
            "--disable-hybrid-kv-cache-manager or without kvfabric"
        )


def check_groups(info: compat.EngineInfo, cfg: ConnectorConfig) -> None:
    """Refuse, with the fix, what kvfabric cannot do with several KV cache groups."""
    if len(info.group_windows) > 1 and cfg.layerwise:
        raise ValueError(
            "kvfabric: layer-wise transfers (layerwise=true) are not supported with several KV "
            "cache groups (sliding-window / hybrid models): set layerwise=false, or run with "
            "--disable-hybrid-kv-cache-manager"
        )


def kv_layout_key(kv_cache_config: Any, signature: str | None, layerwise: bool) -> str:
    """The ``kv_layout`` field of the fingerprint (see docs/hashing.md, "The connector's
    fingerprint"): the KV cache spec of each group, the signature of the physical layout
    (``?`` when this vLLM cannot say), and whether blocks are stored layer by layer. Not
    the Delegator: it changes how the pieces travel, not the bytes the store keeps."""
    specs = []
    for g in getattr(kv_cache_config, "kv_cache_groups", None) or []:
        s = g.kv_cache_spec
        specs.append(
            f"{type(s).__name__}:{getattr(s, 'num_kv_heads', '?')}x{getattr(s, 'head_size', '?')}"
            f":{getattr(s, 'dtype', '?')}:{len(g.layer_names)}L:{getattr(s, 'page_size_bytes', '?')}"
        )
    return f"{';'.join(specs) or 'unknown'}|phys={signature or '?'}|layerwise={int(layerwise)}"


def _fingerprint(
    cfg: ConnectorConfig, info: compat.EngineInfo, kv_cache_config: Any, signature: str | None
) -> hashing.Fingerprint:
    layout = kv_layout_key(kv_cache_config, signature, cfg.layerwise)
    return hashing.Fingerprint(info.model, info.dtype, layout, info.block_size, info.tp_size)


def _block_bytes_guess(kv_cache_config: Any) -> int:
    total = 0
    for g in getattr(kv_cache_config, "kv_cache_groups", None) or []:
        page = getattr(g.kv_cache_spec, "page_size_bytes", 0) or 0
        total += int(page) * len(g.layer_names)
    return max(total, 1)


def _index_layout(kv_cache_config: Any, layerwise: bool) -> StoreLayout:
    """The layout the scheduler's index checks: a shard per layer when layer-wise (a block
    counts once every layer is stored), one otherwise; sizes only matter to a store
    registered without an index."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    layers = sum(len(g.layer_names) for g in groups)
    return StoreLayout((_block_bytes_guess(kv_cache_config),), num_shards=max(layers, 1) if layerwise else 1)


def _group_layers(kv_cache_config: Any) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(g.layer_names) for g in kv_cache_config.kv_cache_groups)


class KVFabricConnector(compat.KVConnectorBase_V1, compat.SupportsHMA):
    """The kvfabric KV connector (see module docstring)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        try:
            super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        except TypeError:  # older vLLM: (vllm_config, role)
            super().__init__(vllm_config=vllm_config, role=role)
        kvt = vllm_config.kv_transfer_config
        self.info = compat.engine_info(vllm_config, kv_cache_config)
        self.one_process = stores.one_process(vllm_config)  # scheduler and worker together
        self.cfg = (
            load_config(kvt.kv_connector_extra_config)
            .resolved(self.info.device_type == "cpu")
            .placed(self.one_process)
        )
        self.is_scheduler = compat.is_scheduler(role)
        self.cfg.log_once("scheduler" if self.is_scheduler else "worker")
        check_engine(self.info)
        self.multi_group = len(self.info.group_windows) > 1
        check_groups(self.info, self.cfg)
        stores.check_shared(self.cfg, self.one_process)
        if getattr(kvt, "kv_load_failure_policy", "recompute") != "recompute":
            log.warning(
                "kvfabric: kv_load_failure_policy is %r; set it to 'recompute' so a block that fails "
                "to load is recomputed instead of failing the request",
                kvt.kv_load_failure_policy,
            )
        # each role owns its platform (closed at shutdown): a worker's is bound to its own
        # local device (each TP rank its own); the scheduler's only serves its index. Not
        # the process-wide default: that one was made under whatever environment (shared
        # memory directory, platform) held when something in the process first asked for
        # it, which need not be this engine's
        self._own_platform = True
        self.platform: Platform = devices.worker_platform(
            self.cfg.platform, 0 if self.is_scheduler else devices.local_device_index()
        )
        geometry, layout_name = compat.expected_kv_geometry(vllm_config, kv_cache_config)
        self.expected_layout: str | None = None  # the physical layout's signature the ids cover
        self._layout_note = layout_name  # the layout's name, or why it is not covered
        if geometry is not None and self.info.num_blocks:
            expected = layout_from_tensors(geometry, int(self.info.num_blocks), self.info.block_strides)
            self.expected_layout = expected.signature
        elif geometry is not None:
            self._layout_note = "unknown: kv_cache_config does not give the block count"
        self._hasher = hashing.BlockHasher(
            _fingerprint(self.cfg, self.info, kv_cache_config, self.expected_layout)
        )
        fp = self._hasher.fingerprint
        log.info(  # what `kvfabric doctor --fingerprint` compares between two engines
            "kvfabric: block ids use fingerprint %s %s",
            fp.digest().hex()[:16],
            json.dumps(fp.to_mapping(), sort_keys=True),
        )
        self._tracer = Tracer(self.cfg.otlp_endpoint)
        self.kv_events = compat.kv_events_enabled(vllm_config) and KVFabricKVEvents is not None
        self.tier = events.event_tier(self.cfg.store, _pipeline_write(self.cfg))
        self._kv_cache_config = kv_cache_config
        self._index: stores.SchedulerIndex | None = None
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if self.is_scheduler:
            k = self.info.block_size // self.info.hash_block_size if self.info.hash_block_size else 1
            self.scheduler = SchedulerSide(
                self.info.block_size,
                self._hasher.hash_engine,
                self._lookup_prefix,
                hashes_per_block=max(k, 1),
                load=self.info.kv_consumer,
                save=self.info.kv_producer,
                tracer=self._tracer,
                async_load=bool(self.cfg.async_load),
                pd_wait_s=self.cfg.pd_wait_s,
                fingerprint=self._hasher.fingerprint.digest().hex()[:16],
                windows=self.info.group_windows if self.multi_group else (),
                lookup_present=self._lookup_present,
                events=events.StoredBlocks(1 if self.info.use_mla else self.info.tp_size)
                if self.kv_events
                else None,
                trace_attrs={
                    "store": self.cfg.store,
                    **({"sparse_algorithm": self.cfg.sparse} if self.cfg.sparse else {}),
                },
                lookup_tier=self.cfg.store if self.one_process else self.cfg.stores[-1],
            )
        else:
            self.worker = WorkerSide(
                self.cfg,
                self.platform,
                lambda layout: stores.acquire(self.cfg, self.platform, layout),
                rank=compat.tp_rank(),
                mla=self.info.use_mla,
                load=self.info.kv_consumer,
                save=self.info.kv_producer,
                tracer=self._tracer,
                compute_done=self._compute_done,
                expected_layout=self.expected_layout,
                layout_note=self._layout_note,
                groups=_group_layers(kv_cache_config) if self.multi_group else (),
                report_dumps=self.kv_events,
                dump_tier=self.tier.kind.value,
            )
        _instances.add(self)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a future miss, not a lost hand-off

    # ------------------------------------------------------------------ helpers
    def _compute_done(self) -> Event | None:
        """Order dumps after the forward's kernels: an event on the framework's current
        stream that the copy stream waits on (no host synchronize); None on the host
        (the CPU forward is synchronous)."""
        return devices.compute_done_event(self.platform)

    def _lookup_prefix(self, ids: Any) -> int:
        """The scheduler's lookups: an index of the shared tier, or this process's worker
        store (``stores.SchedulerIndex``); never a store of its own. With TP > 1 every rank
        stores its own heads under its own ids: the prefix counts only the blocks every
        rank holds, so all ranks load the same blocks (MLA: rank 0's, which all load)."""
        if self._index is None:
            layout = _index_layout(self._kv_cache_config, self.cfg.layerwise)
            self._index = stores.SchedulerIndex(self.cfg, self.platform, layout)
        ranks = 1 if self.info.use_mla else self.info.tp_size
        hit = int(self._index.lookup_prefix(ids))
        for r in range(1, ranks):
            if not hit:
                break
            hit = min(hit, int(self._index.lookup_prefix(hashing.tag(ids[:hit], r, 0))))
        return hit

    def _lookup_present(self, ids: Any, group: int) -> Any:
        """Several groups: which of the blocks ``ids`` (base ids) the store holds for
        ``group``, on every rank (MLA: rank 0's)."""
        import numpy as np

        if self._index is None:
            layout = _index_layout(self._kv_cache_config, self.cfg.layerwise)
            self._index = stores.SchedulerIndex(self.cfg, self.platform, layout)
        ranks = 1 if self.info.use_mla else self.info.tp_size
        present = np.asarray(self._index.lookup(hashing.tag(ids, 0, group)), bool)
        for r in range(1, ranks):
            if not present.any():
                break
            present &= np.asarray(self._index.lookup(hashing.tag(ids, r, group)), bool)
        return present

    def _plan(self) -> StepPlan | None:
        meta = self._connector_metadata
        return meta.plan if isinstance(meta, KVFabricMetadata) else None

    # ------------------------------------------------------------------ worker role
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self.worker is not None
        nb = self.info.num_blocks
        if not nb:
            raise ValueError("kvfabric needs the KV cache block count (kv_cache_config.num_blocks)")
        self.worker.register(kv_caches, int(nb), self.info.block_strides)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        plan = self._plan()
        if self.worker is not None and plan is not None:
            self.worker.start_load(plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.worker is not None:
            self.worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        if self.worker is not None:
            self.worker.save_layer(layer_name, self._plan())

    def wait_for_save(self) -> None:
        if self.worker is not None:
            self.worker.wait_for_save(self._plan())

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        if self.worker is not None and isinstance(kv_connector_metadata, KVFabricMetadata):
            self.worker.preempted(kv_connector_metadata.plan.preempted)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose dumps released their blocks, requests whose asynchronous load
        ended); a failed async load is reported too, its blocks in
        ``get_block_ids_with_load_errors`` of the same step."""
        if self.worker is None:
            return None, None
        return self.worker.finished() or None, self.worker.finished_loads() or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """``get_finished``'s sets, and (several KV cache groups) the requests whose
        asynchronous load failed, which vLLM recomputes (also in ``finished_recving``)."""
        sending, recving = self.get_finished(finished_req_ids)
        failed = self.worker.failed_loads() if self.worker is not None else set()
        return compat.KVConnectorTransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(recving or ()) | failed,
            failed_recving=failed,
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Engine blocks whose load failed; always empty with several KV cache groups
        (those fail per request, see ``get_transfer_results``)."""
        return self.worker.failed_blocks() if self.worker is not None else set()

    def get_kv_connector_stats(self) -> Any:
        side = self.worker if self.worker is not None else self.scheduler
        data = side.stats.take() if side is not None else None
        if data is None or KVFabricStats is None:
            return None
        return KVFabricStats(data)

    def get_kv_connector_kv_cache_events(self) -> Any:
        """KV events on: this worker's reports of the dumps its store answered for since the
        last step (``events.py``); None when there are none or events are off."""
        if self.worker is None or not self.kv_events:
            return None
        reports = self.worker.take_reports()
        return KVFabricKVEvents(reports) if reports else None

    def take_events(self) -> Any:
        """KV events on: vLLM's ``BlockStored`` for the blocks every storing rank reported
        stored since the last call, in kvfabric's tier (``events.py``)."""
        if self.scheduler is None or not self.kv_events:
            return ()
        return [compat.block_stored(run, self.tier) for run in self.scheduler.take_stored()]

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        return None if KVFabricStats is None else KVFabricStats(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Any:
        """The counters on vLLM's ``/metrics`` as ``vllm:kvfabric_*`` (see ``prom.py``)."""
        from kvfabric.ucm_layer.connector import prom

        return prom.build(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        _instances.discard(self)
        if self.worker is not None:
            opened = list(self.worker.stores)
            self.worker.close()
            for store in opened:
                stores.release(store)
        if self._index is not None:
            self._index.close()
        if self.scheduler is not None:
            self.scheduler.spans.close()
        if self._own_platform and not self.platform.closed:
            self.platform.close()

    # ------------------------------------------------------------------ scheduler role
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.scheduler is None:
            return 0, False
        return self.scheduler.match(compat.request_view(request), num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self.scheduler is not None:
            self.scheduler.after_alloc(
                compat.request_view(request),
                compat.block_ids_of(blocks),
                num_external_tokens,
                compat.group_block_ids_of(blocks) if self.multi_group else (),
            )

    def build_connector_meta(self, scheduler_output: Any) -> KVFabricMetadata:
        assert self.scheduler is not None
        plan = self.scheduler.build_plan(
            compat.new_reqs(scheduler_output),
            compat.cached_reqs(scheduler_output),
            compat.num_scheduled(scheduler_output),
            compat.preempted_ids(scheduler_output),
        )
        return KVFabricMetadata(plan)

    def update_connector_output(self, connector_output: Any) -> None:
        """After each step with worker output: blocks whose load failed (the union over
        workers) are set back in their requests, so vLLM's recompute dumps them again."""
        if self.scheduler is not None:
            self.scheduler.load_failed(getattr(connector_output, "invalid_block_ids", None) or ())
            failed = getattr(connector_output, "failed_recving", None)
            if failed:
                self.scheduler.load_failed_requests(failed)
            reports = getattr(connector_output, "kv_cache_events", None)
            if KVFabricKVEvents is not None and isinstance(reports, KVFabricKVEvents):
                self.scheduler.dumps_reported(reports.get_all_events())
            self.scheduler.released(getattr(connector_output, "finished_sending", None))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self.scheduler is None:
            return False, None
        params = getattr(request, "kv_transfer_params", None)
        return self.scheduler.finish(request.request_id, params if isinstance(params, dict) else None)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished`` for every KV cache group at once (``SupportsHMA``): whether
        vLLM keeps all the request's blocks until the workers release its dumps."""
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])
