"""Benchmarks, run as ``kvfabric bench NAME [--quick] [--json]``.

One registry: name -> ``"module:function"``, imported only when that benchmark runs. A
benchmark function takes a :class:`~kvfabric.bench.report.BenchContext` and yields result
rows (dicts); every row carries the comparison measured in the same run as a ratio.
"""

from __future__ import annotations

BENCHMARKS: dict[str, str] = {
    "copy": "kvfabric.bench.copy:run",
    "xcopy": "kvfabric.bench.xcopy:run",
    "e2e": "kvfabric.bench.e2e:run",
    "gsa": "kvfabric.bench.sparse.run:run",
    "pool": "kvfabric.bench.pool:run",
    "rpc": "kvfabric.bench.rpc:run",
    "store": "kvfabric.bench.store:run",
}

__all__ = ["BENCHMARKS"]
