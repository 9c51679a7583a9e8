"""A remote peer that stops answering: reads give up within GvaConfig.remote_read_timeout.

Two processes act as two nodes (Mooncake over TCP on loopback); the peer is frozen with
SIGSTOP while it is still a member. The scenario (``gva_remote_stall_scenario.py``)
reports what it saw; this checks the bound, the untouched destination (also after the
read given up completed late) and that the peer is suspect, then cleared.
"""

from __future__ import annotations

import pytest
from netns import scenario

from kvfabric.pool.gva.config import GvaConfig


def test_stalled_peer_read_gives_up_in_time_and_never_lands_in_the_destination():
    out = scenario("gva_remote_stall_scenario.py", timeout=120)
    bound = out["timeout"]
    assert out["first_read"] == "ok" and out["first_bytes_ok"] is True, out
    # frozen peer: the read fails at the deadline, not at the engine's own 30 s
    assert "did not complete within" in out["stalled"], out
    assert bound * 0.8 <= out["stalled_s"] < bound + 1.0, out
    assert out["untouched_after_stall"] is True, out
    # then suspect: refused without waiting, single piece and batch alike
    assert "suspect" in out["suspect"], out
    assert out["suspect_s"] < bound / 2, out
    assert out["batch_failed"] is True and out["batch_s"] < bound / 2, out
    # resumed: the late read finished into staging, the destination is still untouched
    assert out["given_up_left"] == 0, out
    assert out["untouched_after_resume"] is True, out
    assert out["suspect_cleared"] is True, out
    assert out["read_after_resume"] == "ok" and out["bytes_after_resume_ok"] is True, out


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        ("remote_read_timeout", -1, "remote_read_timeout"),
        ("remote_read_timeout", "soon", "remote_read_timeout"),
        ("remote_suspect_time", -0.5, "remote_suspect_time"),
    ],
)
def test_remote_read_settings_are_checked(key, value, needle):
    with pytest.raises((ValueError, TypeError), match=needle):
        GvaConfig.from_mapping({key: value})
