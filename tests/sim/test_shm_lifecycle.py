"""Shared-memory segments never outlive their owner: freed, exited, or killed."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap

import pytest
from kvf_testing import segments

from kvfabric.platform import shm
from kvfabric.platform.sim import SimPlatform
from kvfabric.platform.types import Medium

CHILD = textwrap.dedent("""
    import sys, time
    from kvfabric.platform.sim import SimPlatform
    p = SimPlatform()
    a = p.alloc(1 << 20, "dram", shareable=True)
    b = p.alloc(1 << 16, "hbm", shareable=True)
    print("ready", flush=True)
    mode = sys.argv[1]
    if mode == "hang":
        time.sleep(600)
    elif mode == "raise":
        raise RuntimeError("boom")
""")


def _spawn(mode: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, mode], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_free_unlinks_and_files_are_private(isolated_shm):
    p = SimPlatform()
    buf = p.alloc(4096, Medium.DRAM, shareable=True)
    (name,) = segments(isolated_shm)
    assert stat.S_IMODE(os.stat(isolated_shm / name).st_mode) == 0o600
    assert name.startswith(f"kvf.{os.getpid()}.")
    p.free(buf)
    assert segments(isolated_shm) == []
    p.close()


@pytest.mark.parametrize("mode", ["exit", "raise"])
def test_owner_exit_unlinks_its_segments(isolated_shm, mode):
    proc = _spawn(mode)
    proc.wait(30)
    assert segments(isolated_shm) == []


def test_killed_owner_segments_are_swept_at_next_start(isolated_shm):
    proc = _spawn("hang")
    left = segments(isolated_shm)
    assert len(left) == 2
    assert all(s.owner_alive for s in shm.list_segments())
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert segments(isolated_shm) == left  # SIGKILL: the owner could not clean up
    assert not any(s.owner_alive for s in shm.list_segments())
    p = SimPlatform()  # the next start sweeps segments of dead owners
    try:
        assert sorted(p.swept) == left
        assert segments(isolated_shm) == []
    finally:
        p.close()


def test_cli_sweep_removes_dead_owners_only(isolated_shm):
    keep = SimPlatform(config=None)
    mine = keep.alloc(4096, Medium.HBM, shareable=True)
    proc = _spawn("hang")
    proc.kill()
    proc.wait(30)
    assert len(segments(isolated_shm)) == 3
    out = subprocess.run(
        [sys.executable, "-m", "kvfabric.cli", "shm", "sweep"], capture_output=True, text=True, check=True
    )
    assert "removed 2 segment(s)" in out.stdout
    assert len(segments(isolated_shm)) == 1
    keep.free(mine)
    keep.close()


def test_importer_keeps_its_mapping_after_the_owner_frees(isolated_shm):
    owner, reader = SimPlatform(), SimPlatform()
    buf = owner.alloc(4096, Medium.HBM, shareable=True)
    buf.numpy()[:] = 9
    mapped = reader.import_handle(owner.export_handle(buf))
    owner.free(buf)
    assert segments(isolated_shm) == []  # the name is gone...
    assert int(mapped.numpy()[100]) == 9  # ...the mapping still works until it is closed
    reader.close()
    owner.close()
