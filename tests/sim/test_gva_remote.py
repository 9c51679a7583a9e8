"""Two processes acting as two nodes move bytes through the remote transport (Mooncake, TCP)."""

from __future__ import annotations

from netns import scenario


def test_two_nodes_copy_through_mooncake_on_loopback():
    out = scenario("gva_remote_scenario.py", timeout=240)
    assert out["route"].startswith("127.0.0.1:")
    for key in ("write_read_1mib", "batch_status_ok", "batch_bytes_ok", "b_to_a_ok", "b_pattern_ok"):
        assert out[key] is True, (key, out)
    assert out["leave_seen_s"] < 5.0
    assert out["copy_to_dead"].startswith("RankUnavailable"), out
