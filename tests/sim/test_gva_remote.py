"""Two processes acting as two nodes move bytes through the remote transport (Mooncake, TCP)."""

from __future__ import annotations

import json
import sys

import pytest
from kvf_testing import REPO
from netns import run_isolated, why_not


def test_two_nodes_copy_through_mooncake_on_loopback():
    reason = why_not()
    if reason is not None:
        pytest.skip(reason)
    script = REPO / "tests" / "support" / "gva_remote_scenario.py"
    r = run_isolated([sys.executable, str(script)], timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["route"].startswith("127.0.0.1:")
    for key in ("write_read_1mib", "batch_status_ok", "batch_bytes_ok", "b_to_a_ok", "b_pattern_ok"):
        assert out[key] is True, (key, out)
    assert out["leave_seen_s"] < 5.0
    assert out["copy_to_dead"].startswith("RankUnavailable"), out
