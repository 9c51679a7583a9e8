"""The console script, run as a user would."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from kvf_testing import kvfabric_command


def _kvfabric(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}  # rich wraps table cells at its default 80 columns
    return subprocess.run(
        [*kvfabric_command(), *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_info():
    out = _kvfabric("info")
    assert out.returncode == 0, out.stderr
    assert "platform sim" in out.stdout and "numpy" in out.stdout


def test_demo_runs_end_to_end():
    """``--quick``: every step and check of the demo, on less memory and the tiny model."""
    out = _kvfabric("demo", "--quick")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "demo OK" in out.stdout
    assert (
        "peer digest matches" in out.stdout and "bytes match" in out.stdout and "MISMATCH" not in out.stdout
    )
    assert "8 blocks of 122 pieces" in out.stdout and "all stored" in out.stdout  # the pool's part
    assert "bytes match, 1 miss" in out.stdout
    assert "still owned by this process after close: 0" in out.stdout
    if "vLLM part skipped" not in out.stdout:  # the connector's part: cold, then loaded warm
        assert "tiny random Llama" in out.stdout and "prefix loaded via kvfabric" in out.stdout
        assert "same first token" in out.stdout and "DIFFERENT" not in out.stdout


@pytest.mark.slow
def test_bench_copy_quick_json():
    out = _kvfabric("bench", "copy", "--quick", "--json")
    assert out.returncode == 0, out.stderr
    everything = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    rows = [r for r in everything if "skipped" not in r]  # page kinds this machine lacks say why
    assert all(r["skipped"] and r["pages"] in ("thp", "hugetlb") for r in everything if "skipped" in r)
    assert {r["case"] for r in rows} == {"in-process", "cross-process"}
    assert {r["nbytes"] for r in rows} >= {4096, 1 << 20, 64 << 20}
    assert "4k" in {r["pages"] for r in rows if r["case"] == "cross-process"}
    for r in rows:
        assert r["bench"] == "copy"
        for key in ("gbps", "memcpy_gbps", "ratio_vs_memcpy", "p50_us"):
            assert r[key] > 0, (key, r)
        assert r["ratio_vs_memcpy"] == pytest.approx(r["gbps"] / r["memcpy_gbps"], rel=0.02)


def test_bad_input_is_a_clear_error():
    out = _kvfabric("bench", "nope")
    assert out.returncode == 2 and "unknown benchmark 'nope'" in out.stderr
    out = _kvfabric("--platform", "tpu", "info")
    assert out.returncode == 2 and "unknown platform 'tpu'" in out.stderr


def test_shm_list():
    out = _kvfabric("shm", "list")
    assert out.returncode == 0 and "kvfabric segments" in out.stdout
