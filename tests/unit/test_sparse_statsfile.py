"""The sparse backend's stats file: written by its thread off the forward path, the latest
snapshot wins, ``close`` writes at once, a failing write never reaches the publisher."""

from __future__ import annotations

import json
import os
import time

from kvfabric.ucm_layer.sparse.vllm.statsfile import StatsFile


def _wait_for(path, want, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            got = json.loads(path.read_text())
        except (OSError, ValueError):
            got = None
        if got == want:
            return got
        time.sleep(0.01)
    raise AssertionError(f"{path} never held {want}")


def test_the_thread_writes_the_latest_snapshot_and_close_writes_at_once(tmp_path) -> None:
    path = tmp_path / "stats.json"
    sf = StatsFile(str(path), interval_s=0.05)
    sf.publish({"steps": 1})
    _wait_for(path, {"steps": 1})  # no close: the thread wrote it
    for i in range(2, 200):
        sf.publish({"steps": i})
    _wait_for(path, {"steps": 199})  # coalesced: the last one is what stays
    sf.publish({"steps": 200})
    sf.close()
    assert json.loads(path.read_text()) == {"steps": 200}  # at once, no wait
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
    sf.publish({"steps": 201})  # after close: kept, never written by a stopped thread
    time.sleep(0.1)
    assert json.loads(path.read_text()) == {"steps": 200}


def test_a_write_that_fails_is_logged_and_retried_with_the_next_snapshot(tmp_path, caplog) -> None:
    where = tmp_path / "gone"
    path = where / "stats.json"
    sf = StatsFile(str(path), interval_s=0.0)
    sf.publish({"steps": 1})  # the directory does not exist: the write fails, nothing raises
    deadline = time.monotonic() + 5
    while "cannot write the stats file" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "cannot write the stats file" in caplog.text
    where.mkdir()
    sf.publish({"steps": 2})
    _wait_for(path, {"steps": 2})
    sf.close()
