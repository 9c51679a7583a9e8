"""kvfabric's connector counters on vLLM's Prometheus ``/metrics`` (``build_prom_metrics``).

vLLM's Prometheus logger builds one :class:`KVFabricPromMetrics` per process that serves
``/metrics`` (``KVConnectorProm``) and calls ``observe(data, engine_idx)`` with each
step's connector stats: the workers' windows merged with the scheduler's (``metrics.py``),
as the plain dict ``SchedulerStats.kv_connector_stats`` carries. Every counter of
``metrics.COUNTERS`` becomes ``vllm:kvfabric_<name>_total`` and the latency samples
``vllm:kvfabric_load_seconds`` / ``vllm:kvfabric_save_seconds`` histograms, each with
vLLM's labels (model name, engine index). The metric objects are vLLM's choice
(``metric_types``), registered in vLLM's registry under the ``vllm:`` prefix, so vLLM's
own clean-up (``unregister_vllm_metrics``) removes them too. Only ``observe`` mutates;
the dict it is given is not kept.
"""

from __future__ import annotations

from typing import Any

from kvfabric.ucm_layer.connector import compat, metrics

PREFIX = "vllm:kvfabric_"
_DOCS = {
    "lookups": "Prefix lookups by the scheduler.",
    "lookup_hits": "Lookups where kvfabric's store added at least one block to vLLM's own hit.",
    "lookup_misses": "Lookups of one or more full blocks the store did not hold.",
    "lookup_below_block": "Lookups of prompts shorter than one block (no block id; not misses).",
    "requested_tokens": "Prompt tokens of the requests looked up.",
    "hit_tokens": "Tokens of the looked-up prefixes already computed (vLLM's cache and kvfabric's).",
    "external_hit_tokens": "Tokens of the looked-up prefixes kvfabric's store holds beyond vLLM's cache.",
    "loaded_blocks": "KV blocks loaded from the store.",
    "loaded_bytes": "Bytes loaded from the store.",
    "load_failed_blocks": "KV blocks whose load failed (recomputed by vLLM).",
    "saved_blocks": "KV blocks stored.",
    "saved_bytes": "Bytes stored.",
    "save_failed_blocks": "KV blocks whose store failed.",
    "repair_blocks": "KV blocks planned to be stored again after a failed load.",
}
_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def _doc(counter: str) -> str:
    reason = counter.removeprefix("load_failed_")
    return _DOCS.get(counter) or f"KV blocks whose load failed, reason {reason}."


def _per_engine(metric: Any, per_engine_labelvalues: dict[int, list[object]]) -> dict[int, Any]:
    return {idx: metric.labels(*values) for idx, values in per_engine_labelvalues.items()}


_Base: Any = compat.KVConnectorPromMetrics if compat.KVConnectorPromMetrics is not None else object


class KVFabricPromMetrics(_Base):  # type: ignore[misc,valid-type]
    """The connector's counters and latency histograms, one child per engine."""

    def __init__(self, *args: Any) -> None:
        """vLLM's arguments, as ``build_prom_metrics`` got them (vllm_config, metric_types,
        labelnames, per_engine_labelvalues); the base class keeps them."""
        super().__init__(*args)
        labelnames, per_engine_labelvalues = self._labelnames, self.per_engine_labelvalues
        self.counters = {
            name: _per_engine(
                self._counter_cls(name=PREFIX + name, documentation=_doc(name), labelnames=labelnames),
                per_engine_labelvalues,
            )
            for name in metrics.COUNTERS
        }
        self.histograms = {
            name: _per_engine(
                self._histogram_cls(
                    name=f"{PREFIX}{name.removesuffix('_s')}_seconds",
                    documentation=f"Seconds per batched {name.removesuffix('_s')} of KV blocks.",
                    buckets=list(_BUCKETS),
                    labelnames=labelnames,
                ),
                per_engine_labelvalues,
            )
            for name in metrics.SAMPLES
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, children in self.counters.items():
            value = int(transfer_stats_data.get(name, 0) or 0)
            if value > 0:
                children[engine_idx].inc(value)
        for name, children in self.histograms.items():
            for x in transfer_stats_data.get(name) or ():
                children[engine_idx].observe(float(x))


def build(*args: Any) -> KVFabricPromMetrics | None:
    """``build_prom_metrics`` of the connector (vLLM's arguments, passed on); None on a vLLM
    without per-connector metrics."""
    if compat.KVConnectorPromMetrics is None:
        return None
    return KVFabricPromMetrics(*args)
