"""``kvfabric bench xcopy --quick --json`` runs and reports every field the issue asks for."""

from __future__ import annotations

import json
import subprocess

import pytest
from kvf_testing import kvfabric_command

FIELDS = ("bench", "case", "nbytes", "pieces", "gbps", "memcpy_gbps", "ratio_vs_memcpy", "p50_us", "p99_us")


@pytest.mark.slow
def test_bench_xcopy_quick_json():
    out = subprocess.run(
        [*kvfabric_command(), "bench", "xcopy", "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    measured = [r for r in rows if "skipped" not in r]
    cases = {r["case"] for r in measured}
    assert {"mapped", "mapped-block"} <= cases
    assert {r["nbytes"] for r in measured if r["case"] == "mapped"} >= {64 << 10, 1 << 20, 64 << 20}
    block = next(r for r in measured if r["case"] == "mapped-block")
    assert block["pieces"] == 122 and block["nbytes"] == 61 * (128 << 10) + 61 * (16 << 10)
    assert block["memcpy_contiguous_gbps"] > 0 and block["ratio_vs_contiguous"] > 0
    for r in (r for r in measured if r["case"] == "mapped"):  # the fabric's share, beside it
        assert r["platform_copy_ratio_vs_memcpy"] > 0 and r["platform_copy_p50_us"] > 0
    for r in measured:
        for key in FIELDS:
            assert key in r, (key, r)
        assert r["gbps"] > 0 and r["memcpy_gbps"] > 0 and r["p99_us"] >= r["p50_us"] > 0
        assert r["other_cores"] in ("busy", "idle")
    for r in measured:
        if r["case"].startswith("remote"):
            assert r["ratio_vs_engine"] > 0 and r["engine_gbps"] > 0
    skipped = [r for r in rows if "skipped" in r]
    assert not skipped or all(r["skipped"] for r in skipped)
