"""The pool keeps a starved rank's objects and drops a stopped one's.

In the pool a false eviction is expensive: every object stored in the evicted rank's window
goes with it. A client with its own window puts objects (some land in its window), then its
GIL is held by one C call for 4x the daemon's ``session_ttl_s``: every object is still there,
byte for byte. The control: the same client SIGSTOPped loses them after ttl + grace, so the
check above can see an eviction when there is one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvf_testing import segments
from pool_testing import Daemon, content

from kvfabric.pool import connect

KiB, MiB = 1 << 10, 1 << 20
TTL = 1.0
SUPPORT = str(Path(__file__).resolve().parents[1] / "support")

_OWNER = """
import json, sys
sys.path.insert(0, {support!r})
from cpuhog import hold_gil
from pool_testing import content
from kvfabric.pool import connect
from kvfabric.pool.status import Status
c = connect(sys.argv[1], window_bytes=2 << 20)
keys = [sys.argv[2] + str(i) for i in range(24)]
st = c.batch_put(keys, [content(k, 100 << 10) for k in keys])
assert (st == Status.OK).all(), st
mine = [k for k in keys if c.addr.decode(int(c.table.lookup(k.encode()).gva))[1] == c.rank]
print(json.dumps({{"rank": c.rank, "keys": keys, "mine": mine}}), flush=True)
for line in sys.stdin:
    if line.startswith("gil"):
        held = hold_gil(float(line.split()[1]), busy=False)
        print(json.dumps({{"held": held, "state": c.fabric.state.value}}), flush=True)
    else:
        break
c.close()
"""


def _owner(socket: str, prefix: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _OWNER.format(support=SUPPORT), socket, prefix],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _stored(proc: subprocess.Popen) -> dict:
    info = json.loads(proc.stdout.readline())
    assert info["mine"], "no object landed in the client's own window: nothing would be at stake"
    return info


def _readable(c, keys: list[str]) -> list[str]:
    got = c.batch_get(keys)
    for k, v in zip(keys, got, strict=True):
        assert v is None or v == content(k, 100 * KiB), f"{k}: wrong bytes"
    return [k for k, v in zip(keys, got, strict=True) if v is not None]


def test_a_starved_rank_keeps_its_objects_and_a_stopped_one_loses_them(tmp_path, isolated_shm):
    d = Daemon(tmp_path, dram="16MiB", extra={"session_ttl_s": TTL}).start()
    c = connect(d.socket)
    procs: list[subprocess.Popen] = []
    try:
        procs += [_owner(d.socket, "busy"), _owner(d.socket, "hung")]  # both start at once
        proc, stopped = procs
        info, info2 = _stored(proc), _stored(stopped)
        proc.stdin.write(f"gil {4 * TTL}\n")
        proc.stdin.flush()
        out = json.loads(proc.stdout.readline())
        assert out["held"] >= 4 * TTL - 0.1 and out["state"] == "joined"
        time.sleep(2 * TTL)  # heartbeats again; a drop decided late would show by now
        assert _readable(c, info["keys"]) == info["keys"]  # every object, byte for byte
        assert info["rank"] in c.fabric.table.ranks

        assert _readable(c, info2["keys"]) == info2["keys"]
        os.kill(stopped.pid, signal.SIGSTOP)  # the control: a hung owner does lose its objects
        deadline = time.monotonic() + 30
        while set(info2["mine"]) & set(_readable(c, info2["keys"])) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not set(info2["mine"]) & set(_readable(c, info2["keys"])), "a stopped rank was never dropped"
        assert info2["rank"] not in c.fabric.table.ranks
    finally:
        for p in procs:  # continued and told to close, each frees its own window segment
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.stdin.close()
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        c.close()
        assert d.stop() == 0
    assert segments(isolated_shm) == []
