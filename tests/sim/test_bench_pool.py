"""``kvfabric bench pool`` plumbing at tiny sizes: every case yields a row with the fields
tools read, peers are either measured or say why not, and nothing is left behind.
No performance assertions (figures live in the benchmark's output)."""

from __future__ import annotations

import io
import json

import pytest
from kvf_testing import segments

from kvfabric.bench.report import BenchContext, run
from kvfabric.bench.stores import mooncake as mooncake_store
from kvfabric.bench.stores import mooncake_host
from kvfabric.bench.stores import redis as redis_store

KiB, MiB = 1 << 10, 1 << 20
FIELDS = ("bench", "case", "op", "nbytes", "batch", "clients", "gbps", "p50_us", "p99_us")
RATIOS = ("ratio_vs_memcpy", "ratio_vs_mooncake", "ratio_vs_redis")
TINY = {
    "working_set": 2 * MiB,
    "sizes": [64 * KiB, [16 * KiB, 4 * KiB] * 4],
    "batches": [1, 4],
    "clients": [1, 2],
    "round_s": 0.002,
    "directory_objects": 3000,
    "directory_fill": 3000,
}


def _rows(options: dict) -> list[dict]:
    out = io.StringIO()
    run("pool", BenchContext(quick=True, options=options), as_json=True, out=out)
    return [json.loads(line) for line in out.getvalue().splitlines() if line.strip()]


def _check_peer(row: dict, name: str) -> None:
    info = row[name]
    if row[f"ratio_vs_{name}"] is None:
        assert info["status"] != "ok" and info["status"], row  # says why there is no ratio
    else:
        assert info["status"] == "ok" and info["p50_us"] > 0, row


def test_bench_pool_rows_with_all_peers(isolated_shm):
    rows = _rows({**TINY, "peers": ["mooncake", "redis"]})
    cases = [r for r in rows if r["case"] in ("object", "block", "latency")]
    # 2 shapes x 2 client counts x put/get x 2 batches + 2 latency cases
    assert len(cases) == 2 * 2 * 2 * 2 + 2
    assert {r["op"] for r in cases} == {
        "put_from", "get_into", "batch_put_from", "batch_get_into",
        "put_from_layers", "get_into_layers", "batch_put_from_layers", "batch_get_into_layers",
    }  # fmt: skip
    for r in rows:
        for key in FIELDS:
            assert key in r, (key, r)
        assert r["bench"] == "pool"
    for r in cases:
        for key in RATIOS:
            assert key in r, (key, r)
        assert r["detail"]["errors"] == 0 and "note" not in r, r
        assert r["gbps"] > 0 and r["memcpy"]["gbps"] > 0 and r["p99_us"] >= r["p50_us"] > 0, r
        assert r["other_core"] in ("idle", "busy", "unknown"), r  # unknown: shorter than a tick
        assert r["detail"]["working_set"] > 0 and r["detail"]["rounds"] >= 5, r
        _check_peer(r, "mooncake")
        _check_peer(r, "redis")
        if "get" in r["op"]:  # reads are measured again with checksum verification off
            assert r["ratio_verify_on_vs_off"] > 0 and r["verify_off"]["gbps"] > 0, r
        else:
            assert "ratio_verify_on_vs_off" not in r, r
    exists = [r for r in rows if r["case"] == "exists"]
    assert len(exists) == 2 and all(r["op"] == "batch_exists" and r["p50_us"] > 0 for r in exists)
    (directory,) = [r for r in rows if r["case"] == "directory"]
    d = directory["directory"]
    assert d["filled"] == 3000 and d["objects"] == 3000
    assert 64 <= directory["bytes_per_object"] == d["bytes_per_object"] < d["bytes_per_object_with_keys"]
    assert segments(isolated_shm) == []


def test_peers_that_cannot_run_are_named_in_every_row(isolated_shm, monkeypatch):
    monkeypatch.setattr(redis_store, "missing", lambda: "redis-server is not installed (test)")
    monkeypatch.setattr(mooncake_store, "missing", lambda: None)  # installed or not: it cannot start
    monkeypatch.setattr(mooncake_host, "netns_prefix", lambda: "cannot create a network namespace (test)")
    opts = {**TINY, "sizes": [64 * KiB], "clients": [1], "peers": ["mooncake", "redis"], "directory_fill": 0}
    rows = _rows(opts)
    assert rows
    for r in rows:
        assert r["ratio_vs_redis"] is None and r["ratio_vs_mooncake"] is None
        assert r["redis"]["status"] == "not installed: redis-server is not installed (test)"
        assert r["mooncake"]["status"] == "failed: cannot create a network namespace (test)"
        assert r["gbps"] or r["p50_us"]  # the pool itself was measured
    assert segments(isolated_shm) == []


def test_bad_options_are_clear_errors():
    with pytest.raises(ValueError, match="batch"):
        _rows({**TINY, "batches": [0]})
