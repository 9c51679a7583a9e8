"""Integrity of pool objects under a late writer and corrupted memory.

A hit is never worse than a miss: a writer that wakes up after its lease ran out must not
land on another object's memory (``pool/service/fence.py``), and bytes changed in a window after
their writer sealed them are a miss (``CorruptObject`` / ``Status.CORRUPT``), never served.
Each test plants the fault and then checks every object's bytes.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from kvf_testing import segments
from pool_testing import Daemon, content

from kvfabric.errors import KeyNotFound
from kvfabric.pool import connect
from kvfabric.pool.status import Status

MiB = 1 << 20

# A writer on the same node that allocates, reports where its space is mapped, then waits
# (the test stops it there, as a starved core or SIGSTOP would) and, once told to go on,
# copies into that space the way an in-flight copy resumes, and commits.
_LATE_WRITER = textwrap.dedent(
    """
    import ctypes, json, sys
    from kvfabric.pool import connect
    from kvfabric.pool.status import Status
    c = connect(sys.argv[1])
    size = int(sys.argv[2])
    st, gvas = c.batch_alloc(["late"], [size])
    assert st[0] == Status.OK, st
    ptr, host = c.dp.local(int(gvas[0]), size)
    print(json.dumps({"gva": int(gvas[0])}), flush=True)
    sys.stdin.readline()
    ctypes.memset(ptr, 0xAB, size)  # the copy that was in flight when the writer stalled
    mode = sys.argv[3]
    if mode == "api":  # the client's own write path checks its deadline first
        import numpy as np
        buf = np.full(size, 0xCD, np.uint8)
        c.register_buffer(buf.ctypes.data, size)  # the process exits after: no unregister
        try:
            c.write([int(gvas[0])], [buf.ctypes.data], [size])
            print(json.dumps({"write": "copied"}), flush=True)
        except Exception as e:
            print(json.dumps({"write": type(e).__name__}), flush=True)
    print(json.dumps({"commit": int(c.batch_commit(["late"])[0])}), flush=True)
    c.close()
    """
)


def _late_writer(socket: str, size: int, mode: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", _LATE_WRITER, socket, str(size), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    json.loads(proc.stdout.readline())
    return proc


def _fill(c, prefix: str, n: int, size: int) -> list[str]:
    keys = [f"{prefix}{i}" for i in range(n)]
    for k in keys:  # one by one, so eviction runs as it would under steady traffic
        c.batch_put([k], [content(k, size)])
    return keys


def _check_every_object(c, keys: list[str], size: int) -> int:
    """Every readable object holds exactly its writer's bytes, and none was caught by the
    checksum (the fence must keep late bytes out, not leave it to the readers); returns
    how many are readable."""
    seen = 0
    for k in keys:
        got = c.batch_get([k])[0]
        if got is not None:
            assert got == content(k, size), f"{k}: bytes changed under a reader"
            seen += 1
    assert c.reader.corrupt == 0, f"{c.reader.corrupt} object(s) overwritten by the late writer"
    return seen


def _teardown(proc: subprocess.Popen, c, d: Daemon) -> None:
    if proc.poll() is None:  # a stopped writer must be continued before it can die
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
    c.close()
    assert d.stop() == 0


def _fenced(c) -> int:
    return sum(w.get("fenced", 0) for w in c.info()["capacity"])


@pytest.mark.parametrize("mode", ["raw", "api"])
def test_stopped_writer_wakes_after_its_lease_and_lands_on_nobody(tmp_path, isolated_shm, mode):
    d = Daemon(tmp_path, dram="32MiB", extra={"write_lease_s": 0.5, "fence_grace_s": 1.0}).start()
    c = connect(d.socket)
    proc = _late_writer(d.socket, 8 * MiB, mode)
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(0.5 + 1.0 + 1.0)  # past the lease and past the grace: still fenced (pid alive)
        assert _fenced(c) >= 8 * MiB
        keys = _fill(c, "victim", 27, MiB)  # 27 MiB into a 32 MiB window: all free space taken
        assert _check_every_object(c, keys, MiB) > 0
        os.kill(proc.pid, signal.SIGCONT)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        out = [json.loads(line) for line in proc.stdout]
        assert proc.wait(30) == 0
        if mode == "api":
            assert out[0] == {"write": "LeaseExpired"}  # the client refused to copy late
        assert out[-1] == {"commit": int(Status.LEASE_EXPIRED)}  # never published
        assert _check_every_object(c, keys, MiB) > 0  # and nobody's bytes changed
        assert not c.exists("late") and _fenced(c) == 0  # the commit released the fence
        more = _fill(c, "after", 8, MiB)  # the space is usable again
        assert _check_every_object(c, more, MiB) == 8
    finally:
        _teardown(proc, c, d)
    assert segments(isolated_shm) == []


def test_restart_fences_what_the_previous_daemon_handed_out(tmp_path, isolated_shm):
    extra = {"write_lease_s": 0.5, "fence_grace_s": 3.0}
    d = Daemon(tmp_path, dram="32MiB", extra=extra).start()
    proc = _late_writer(d.socket, 8 * MiB, "raw")
    os.kill(proc.pid, signal.SIGSTOP)
    d.kill()  # the daemon dies with the allocation in flight
    d2 = Daemon(tmp_path, dram="32MiB", extra=extra).start()
    c = connect(d2.socket)
    try:
        assert _fenced(c) >= 8 * MiB  # the new daemon read the old table
        keys = _fill(c, "victim", 27, MiB)
        os.kill(proc.pid, signal.SIGCONT)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        proc.stdout.read()
        proc.wait(30)
        assert _check_every_object(c, keys, MiB) > 0
        deadline = time.monotonic() + 10
        while _fenced(c) and time.monotonic() < deadline:  # released after fence_grace_s
            time.sleep(0.2)
        assert _fenced(c) == 0
    finally:
        _teardown(proc, c, d2)
    assert segments(isolated_shm) == []


def _flip(c, key: str, at: int) -> None:
    hit = c.table.lookup(key.encode())
    ptr, _ = c.dp.local(int(hit.gva) + at, 1)
    b = ctypes.c_uint8.from_address(ptr)
    b.value ^= 0x5A


@pytest.mark.parametrize("local_reads", [True, False])
def test_flipped_byte_in_a_window_is_a_miss_never_the_bytes(tmp_path, isolated_shm, local_reads):
    d = Daemon(tmp_path, dram="32MiB").start()
    writer = connect(d.socket)
    reader = connect(d.socket, local_reads=local_reads)
    trusting = connect(d.socket, verify="off")
    try:
        keys = [f"blk{i}" for i in range(6)]
        sizes = [100, 4096, 64 * 1024, MiB, 3 * MiB, 5 * MiB]
        for k, n in zip(keys, sizes):
            assert writer.put(k, content(k, n)) is Status.OK
        for k, n in zip(keys, sizes):
            _flip(writer, k, n // 2)
        # the control: a reader that does not verify gets the flipped bytes (the fault is real)
        assert trusting.get(keys[0]) != content(keys[0], sizes[0])
        for k in keys[:3]:  # single gets: a miss
            with pytest.raises(KeyNotFound):
                reader.get(k)
        bufs = [np.zeros(n, np.uint8) for n in sizes[3:]]
        regs = [reader.register_buffer(b.ctypes.data, b.nbytes) for b in bufs]
        st = reader.batch_get_into(keys[3:], [b.ctypes.data for b in bufs], [b.nbytes for b in bufs])
        for r in regs:
            reader.unregister_buffer(r)
        assert list(st) == [Status.CORRUPT] * 3  # batches: CORRUPT per key
        assert reader.reader.corrupt == 6
        assert not any(writer.exists(k) for k in keys)  # removed: the next save rewrites them
        assert writer.put(keys[0], content(keys[0], sizes[0])) is Status.OK
        assert reader.get(keys[0]) == content(keys[0], sizes[0])
    finally:
        for c in (writer, reader, trusting):
            c.close()
        assert d.stop() == 0
    assert segments(isolated_shm) == []


def test_objects_written_in_layers_are_sealed_and_checked(tmp_path, isolated_shm):
    d = Daemon(tmp_path, dram="32MiB").start()
    c = connect(d.socket)
    try:
        pieces = [np.full(4096, i, np.uint8) for i in range(8)]
        regs = [c.register_buffer(p_.ctypes.data, p_.nbytes) for p_ in pieces]
        st, gvas = c.batch_alloc(["layered"], [8 * 4096])
        assert st[0] == Status.OK
        for i, p_ in enumerate(pieces):  # one layer at a time, as a layer-wise save does
            c.write([int(gvas[0]) + i * 4096], [p_.ctypes.data], [4096])
        assert c.batch_commit(["layered"])[0] == Status.OK
        assert c.table.lookup(b"layered").csum != 0
        want = np.concatenate(pieces).tobytes()
        assert c.get("layered") == want
        _flip(c, "layered", 5 * 4096 + 7)
        assert c.batch_get(["layered"]) == [None]
        for r in regs:
            c.unregister_buffer(r)
    finally:
        c.close()
        assert d.stop() == 0
