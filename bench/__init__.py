"""Benchmarks, run as ``kvfabric bench NAME [--quick] [--json]``.

One registry (:class:`kvfabric.registry.Registry`): name -> ``"module:function"``, imported
only when that benchmark runs; plugins add theirs through the ``kvfabric.benchmarks``
entry-point group. A benchmark function takes a :class:`~kvfabric.bench.report.BenchContext`
and yields result rows (dicts); every row carries the comparison measured in the same run as
a ratio.
"""

from __future__ import annotations

from kvfabric.registry import Registry

_BUILTIN: dict[str, str] = {
    "copy": "kvfabric.bench.copy:run",
    "xcopy": "kvfabric.bench.xcopy:run",
    "e2e": "kvfabric.bench.e2e:run",
    "gsa": "kvfabric.bench.sparse.run:run",
    "sparse-vllm": "kvfabric.bench.sparse_vllm:run",
    "pool": "kvfabric.bench.pool:run",
    "rpc": "kvfabric.bench.rpc:run",
    "kv-events": "kvfabric.bench.kv_events:run",
    "store": "kvfabric.bench.store:run",
    "serve": "kvfabric.bench.serve:run",
    "cluster": "kvfabric.bench.cluster:run",
}
BENCHMARKS: Registry = Registry("benchmark", _BUILTIN)

__all__ = ["BENCHMARKS"]
