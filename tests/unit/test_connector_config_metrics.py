"""Connector configuration (inline and YAML), stats windows, and spans."""

from __future__ import annotations

import logging

import pytest

from kvfabric.ucm_layer.connector import metrics
from kvfabric.ucm_layer.connector.config import ConnectorConfig, load_config
from kvfabric.ucm_layer.connector.stores import store_config
from kvfabric.ucm_layer.connector.tracing import Tracer


def test_defaults_and_inline_values(monkeypatch, tmp_path):
    monkeypatch.setenv("KVFABRIC_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    cfg = load_config({})
    assert cfg.store in ("cache|pool", "cache|posix")
    assert cfg.posix_path == str(tmp_path / "kv")
    assert cfg.delegator is None and not cfg.layerwise and cfg.otlp_endpoint is None  # auto
    assert cfg.resolved(kv_on_host=False).delegator is True  # device KV cache: gather
    assert cfg.resolved(kv_on_host=True).delegator is False  # host KV cache: one copy fewer
    assert load_config({"delegator": "auto"}).delegator is None
    assert load_config({"delegator": "off"}).resolved(kv_on_host=False).delegator is False
    cfg = load_config(
        {"store": " cache | posix ", "cache_bytes": "64MiB", "layerwise": "true", "staging_blocks": "8"}
    )
    assert (
        cfg.store == "cache|posix"
        and cfg.cache_bytes == 64 << 20
        and cfg.layerwise
        and cfg.staging_blocks == 8
    )
    sc = store_config(cfg)
    assert sc == {"store": "cache|posix", "posix.dirs": cfg.posix_path, "cache.capacity": 64 << 20}


def test_yaml_file_with_inline_override(tmp_path):
    f = tmp_path / "kvf.yaml"
    f.write_text("kvfabric:\n  store: posix\n  posix_path: /data/kv\n  delegator: false\n")
    cfg = load_config({"config_file": str(f), "delegator": True})
    assert cfg.store == "posix" and cfg.posix_path == "/data/kv" and cfg.delegator is True
    assert "posix.dirs" in store_config(cfg) and "cache.capacity" not in store_config(cfg)


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"stroe": "posix"}, "unknown kvfabric config key"),
        ({"store": "cache||posix"}, "pipeline"),
        ({"cache_bytes": "lots"}, "cache_bytes"),
        ({"layerwise": "maybe"}, "layerwise"),
        ({"delegator": "sometimes"}, r"'delegator'='sometimes': expected a boolean \(.*\) or 'auto'"),
        ({"staging_blocks": 0}, "staging_blocks"),
        ({"pool_address": "nohost"}, "pool_address"),
        ({"load_timeout_s": -1}, "load_timeout_s"),
        ({"config_file": "/nonexistent/kvf.yaml"}, "cannot be read"),
    ],
)
def test_bad_config_is_named(extra, match):
    with pytest.raises(ValueError, match=match):
        load_config(extra)


def test_bad_yaml_is_named(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("- a list\n- not a mapping\n")
    with pytest.raises(ValueError, match="mapping"):
        load_config({"config_file": str(f)})


def test_effective_config_logged_once(caplog):
    cfg = ConnectorConfig(store="posix", posix_path="/tmp/x-unique-log-test")
    with caplog.at_level(logging.INFO, logger="kvfabric.connector"):
        cfg.log_once("worker")
        cfg.log_once("worker")
    assert len([r for r in caplog.records if "effective config" in r.message]) == 1


def test_stats_windows_merge_and_reduce():
    w = metrics.StatsWindow()
    assert w.take() is None
    w.add(loaded_blocks=3, loaded_bytes=300, load_s=0.01)
    w.add(requested_tokens=100, hit_tokens=60, lookups=1)
    a = w.take()
    assert a["loaded_blocks"] == 3 and w.take() is None
    b = metrics.empty()
    b["loaded_blocks"], b["load_s"] = 2, [0.03]
    m = metrics.merge(a, b)
    r = metrics.reduce(m)
    assert r["loaded_blocks"] == 5 and r["hit_rate"] == 0.6 and r["load_s_p50_ms"] == 20.0
    assert w.totals["loaded_blocks"] == 3
    assert metrics.is_empty(metrics.empty()) and not metrics.is_empty(m)


def test_load_failures_are_counted_by_reason():
    from kvfabric.ucm_layer.store.base import BlockStatus

    assert {"missing", "failed", "timeout", "cancelled", "error"} <= set(metrics.FAILURE_REASONS)
    assert "ok" not in metrics.FAILURE_REASONS and "pending" not in metrics.FAILURE_REASONS
    assert metrics.failure_reason(BlockStatus.MISSING) == "missing"
    assert metrics.failure_reason(BlockStatus.OK) == "error"  # not a failure: never counted as one
    assert metrics.failure_reason(99) == "error"
    with pytest.raises(ValueError, match="unknown load failure reason 'slow'"):
        metrics.failure_counter("slow")
    w = metrics.StatsWindow()
    w.add(load_failed_blocks=3, load_failed_missing=2, load_failed_error=1)
    m = metrics.merge(w.take(), {"load_failed_blocks": 1, "load_failed_missing": 1})
    r = metrics.reduce(m)
    assert r["load_failed_blocks"] == 4 and r["load_failed_missing"] == 3 and r["load_failed_error"] == 1


def test_spans_are_noops_without_an_endpoint_and_real_with_a_tracer():
    t = Tracer(None)
    assert not t.enabled
    with t.span("kvfabric.lookup", req_id="r") as s:
        s.set(hit_tokens=1)
    sdk = pytest.importorskip("opentelemetry.sdk.trace")
    export = pytest.importorskip("opentelemetry.sdk.trace.export.in_memory_span_exporter")
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    exporter = export.InMemorySpanExporter()
    provider = sdk.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    t = Tracer(None, tracer=provider.get_tracer("test"))
    with t.span("kvfabric.lookup", req_id="r1") as s:
        s.set(requested_tokens=300, hit_tokens=288, hit_rate=0.96)
    (span,) = exporter.get_finished_spans()
    assert span.name == "kvfabric.lookup" and span.attributes["hit_tokens"] == 288


@pytest.mark.parametrize(
    "value,want", [(False, None), ("off", None), (True, "gsa"), ("true", "gsa"), ("quest", "quest")]
)
def test_sparse_names_an_algorithm(value, want):
    assert load_config({"sparse": value}).sparse == want


def test_sparse_rejects_unknown_algorithms():
    with pytest.raises(ValueError, match="'sparse'='magic': expected true/false or one of dense, gsa, hata"):
        load_config({"sparse": "magic"})


def test_pool_address_maps_to_the_pool_store_keys():
    sock = store_config(load_config({"store": "pool", "pool_address": "/run/kvf/pool.sock"}))
    assert sock == {"store": "pool", "pool.socket": "/run/kvf/pool.sock"}
    tcp = store_config(load_config({"store": "cache|pool", "pool_address": "10.0.0.2:7800"}))
    assert tcp["pool.tcp"] == "10.0.0.2:7800" and "cache.capacity" in tcp
    embedded = store_config(load_config({"store": "pool", "pool_bytes": "64MiB"}))
    assert embedded == {"store": "pool", "pool.embedded_dram": 64 << 20}
