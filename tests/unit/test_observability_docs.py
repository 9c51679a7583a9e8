"""docs/observability.md and the Grafana dashboard name only series the code exports, and
the docs name every one of them."""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvfabric.pool.service.metrics import PoolMetrics
from kvfabric.ucm_layer.connector import metrics

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "observability.md"
DASHBOARD = ROOT / "docs" / "grafana" / "kvfabric.json"
SERIES = re.compile(r"(?:vllm:kvfabric_|kvfabric_pool_)[a-z_]+")
HISTOGRAM_PARTS = ("_bucket", "_sum", "_count")


def _pool_series() -> set[str]:
    text = PoolMetrics().render().decode()
    return {line.split(" ")[2] for line in text.splitlines() if line.startswith("# HELP ")}


def _connector_series() -> set[str]:
    out = {f"vllm:kvfabric_{name}_total" for name in metrics.COUNTERS}
    out |= {f"vllm:kvfabric_{name.removesuffix('_s')}_seconds" for name in metrics.SAMPLES}
    return out


def _exported() -> set[str]:
    return _pool_series() | _connector_series()


def _base(series: str, exported: set[str]) -> str:
    for part in HISTOGRAM_PARTS:
        if series.endswith(part) and series.removesuffix(part) in exported:
            return series.removesuffix(part)
    return series


def _dashboard_exprs() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in board["panels"] for t in p.get("targets", ())]


def test_the_docs_name_every_exported_series() -> None:
    text = DOC.read_text()
    missing = sorted(s for s in _exported() if f"`{s}`" not in text)
    assert not missing, f"docs/observability.md lacks {missing}"


def test_the_docs_name_no_series_the_code_does_not_export() -> None:
    exported = _exported()
    unknown = sorted({_base(s, exported) for s in SERIES.findall(DOC.read_text())} - exported)
    assert not unknown, f"docs/observability.md names series nobody exports: {unknown}"


def test_the_dashboard_queries_only_exported_series() -> None:
    exported = _exported()
    used = {_base(s, exported) for e in _dashboard_exprs() for s in SERIES.findall(e)}
    assert used, "the dashboard has no queries"
    unknown = sorted(used - exported)
    assert not unknown, f"docs/grafana/kvfabric.json queries series nobody exports: {unknown}"


def test_the_dashboard_shows_hit_rate_failures_and_on_node_reads() -> None:
    exprs = " ".join(_dashboard_exprs())
    for series in (
        "vllm:kvfabric_hit_tokens_total",
        "vllm:kvfabric_load_failed_corrupt_total",
        "kvfabric_pool_local_hits_total",
        "kvfabric_pool_local_corrupt_total",
    ):
        assert series in exprs, series


def test_the_docs_name_every_span_and_the_dashboard_the_kv_events() -> None:
    from kvfabric.ucm_layer.connector import tracing

    text = DOC.read_text()
    for span in (tracing.ROOT, tracing.LOOKUP, tracing.LOAD, tracing.DUMP, tracing.SPARSE):
        assert f"`{span}`" in text, span
    exprs = " ".join(_dashboard_exprs())
    assert "kvfabric_pool_kv_events_dropped_total" in exprs
