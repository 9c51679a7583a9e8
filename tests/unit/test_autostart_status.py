"""An auto-started daemon's exit status comes from its own run's part of the log: the
subshell that waits for it appends the line, and earlier runs left theirs above."""

from __future__ import annotations

from kvfabric.pool.autostart import _Daemon


def test_the_exit_status_is_this_runs_not_an_earlier_ones(tmp_path):
    sock = str(tmp_path / "p.sock")
    log = tmp_path / "p.sock.log"
    log.write_text("--- the pool daemon exited with status 77\n--- 2026-12-02 pid 1 starts the daemon\n")
    d = _Daemon(pid=2**22 + 1, sock=sock, log_from=log.stat().st_size)
    assert d.status(wait_s=0.05) is None  # this run logged nothing yet: not the earlier 77
    with log.open("a") as f:
        f.write("Traceback ...\n--- the pool daemon exited with status 2\n")
    assert d.status(wait_s=0.05) == 2
    assert not d.running()  # no such process
