"""Replicas across data owners: real daemon, real owner processes killed with SIGKILL.

A pool daemon contributes no memory; two owner processes contribute a window each (two
ranks), so every object stored with ``replicas: 2`` has one extent in each. Through a
planted corruption of one extent, the kill -9 of one owner and the daemon's noticing it,
every read's bytes are compared with what the key must hold: a read passes over an
extent that fails (its checksum, its dead rank) to the other, never returns wrong bytes,
no call blocks 2 s, and once the dead rank has left, every object with two copies is
readable again from the survivor. The objects stored with one copy in the dead owner's
window are the negative control: they are lost (misses), which a pool without replicas
would do to all of them.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import time
from pathlib import Path

from pool_testing import Daemon, content

from kvfabric.pool import connect
from kvfabric.pool import protocol as p
from kvfabric.pool.status import Status

KiB, MiB = 1 << 10, 1 << 20
SIZE = 16 * KiB
OWNER = (
    "import sys, time\n"
    "from kvfabric.pool import connect\n"
    "c = connect(sys.argv[1], window_bytes=4 << 20)\n"
    "print(c.rank, flush=True)\n"
    "sys.stdin.read()\n"
    "c.close()\n"
)


def _owner(socket: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(
        [sys.executable, "-c", OWNER, socket], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def _wait_ranks(c, ranks: list[int]) -> None:
    """Until the service saw every owner's rank join (at most 5 s)."""
    deadline = time.monotonic() + 5
    while set(ranks) - set(c.info()["ranks"]) and time.monotonic() < deadline:
        time.sleep(0.02)


def _stop(owners: list[tuple[subprocess.Popen, int]], d: Daemon, *clients) -> None:
    for proc, _ in owners:
        if proc.poll() is None:
            proc.communicate("", timeout=30)
    for c in clients:
        c.close()
    d.stop()


def _extents(c, keys: list[str]) -> list[list[int]]:
    r = c.session.call(p.Lookup([k.encode() for k in keys], lease=False))
    extra = r.replicas or [[] for _ in keys]
    return [[g, *more] if s == Status.OK else [] for s, g, more in zip(r.status, r.gvas, extra)]


def _read_all(c, keys: list[str], worst: list[float]) -> tuple[int, int]:
    """(right, wrong) over ``keys``, one get each; the longest call into ``worst``."""
    right = wrong = 0
    for k in keys:
        t0 = time.monotonic()
        got = c.batch_get([k])[0]
        worst[0] = max(worst[0], time.monotonic() - t0)
        if got is not None:
            right += got == content(k, SIZE)
            wrong += got != content(k, SIZE)
    return right, wrong


def test_replicas_2_survive_a_killed_data_owner_with_every_byte_checked(tmp_path: Path, isolated_shm):
    d = Daemon(tmp_path, name="rep", dram="0", extra={"replicas": 2, "session_ttl_s": 1.0}).start()
    owners = [_owner(d.socket), _owner(d.socket)]
    c = connect(d.socket)  # no window: every extent lies in an owner's window
    remote = connect(d.socket, local_reads=False)  # reads like a client on another node
    try:
        (a, rank_a), (_b, rank_b) = owners
        _wait_ranks(c, [rank_a, rank_b])
        two = [f"two/{i}" for i in range(48)]
        one = [f"one/{i}" for i in range(16)]
        assert (c.batch_put(two, [content(k, SIZE) for k in two]) == Status.OK).all()
        assert (c.batch_put(one, [content(k, SIZE) for k in one], replicas=1) == Status.OK).all()
        ext = _extents(c, two)
        assert all(sorted(c.addr.decode(g)[1] for g in e) == sorted([rank_a, rank_b]) for e in ext)
        lost = [k for k, e in zip(one, _extents(c, one)) if c.addr.decode(e[0])[1] == rank_a]
        assert lost, "the negative control needs single copies in the owner that dies"

        # a planted fault: the first extent of 8 objects overwritten in place (a checksum miss)
        planted = two[:8]
        for e in ext[:8]:
            ptr, _ = c.dp.local(e[0], SIZE)
            ctypes.memset(ptr, 0x5A, SIZE)
        worst = [0.0]
        assert _read_all(c, planted, worst) == (8, 0)  # served by the other extent
        assert c.reader.corrupt == 8 and c.reader.fallbacks == 8
        assert all(len(e) == 1 for e in _extents(c, planted))  # the corrupt extents were dropped

        # kill -9 of owner A: reads right away, then once the daemon dropped its rank
        a.kill()
        a.wait(10)
        assert _read_all(c, two, worst)[1] == 0  # hits or misses while the rank is dying, never wrong
        deadline = time.monotonic() + 10
        while rank_a in c.info()["ranks"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rank_a not in c.info()["ranks"], "the dead owner's rank never left"
        for reader in (c, remote):
            assert _read_all(reader, two, worst) == (len(two), 0)
        assert all([c.addr.decode(g)[1] for g in e] == [rank_b] for e in _extents(c, two))
        assert _read_all(c, lost, worst) == (0, 0)  # one copy, in the dead window: misses
        # what /metrics says of it: each copy in the dead window of an object that stayed readable
        # is lost (the 8 planted ones had dropped theirs), those that were first extents promoted
        assert d.metric("kvfabric_pool_replicas_lost") == len(two) - 8
        assert 0 < d.metric("kvfabric_pool_promoted") <= len(two) - 8
        assert d.metric("kvfabric_pool_replica_extents") == 0
        assert d.metric("kvfabric_pool_objects") == len(two) + len(one) - len(lost)
        assert worst[0] < 2.0, f"a read blocked {worst[0]:.2f} s"

        # the survivor knows what its window holds (what it re-registers with a new leader)
        assert remote.session.call(p.Held(rank_b)).keys.count(b"two/0") == 1
    finally:
        _stop(owners, d, c, remote)


def test_a_restarted_service_merges_the_extents_each_owner_re_registers(tmp_path: Path, isolated_shm):
    """The owners are idle: their listing of what their windows hold (``Held``, each
    ``replica_sync_s``) is what notices the new service and re-registers; the service puts
    the two extents of each key, reported by two processes, back into one entry."""
    extra = {"replicas": 2, "session_ttl_s": 1.0, "replica_sync_s": 0.2}
    d = Daemon(tmp_path, name="rep2", dram="0", extra=extra).start()
    owners = [_owner(d.socket), _owner(d.socket)]
    c = connect(d.socket)
    try:
        ranks = sorted(r for _, r in owners)
        _wait_ranks(c, ranks)
        keys = [f"k/{i}" for i in range(32)]
        assert (c.batch_put(keys, [content(k, SIZE) for k in keys]) == Status.OK).all()
        time.sleep(0.6)  # the owners' listings include every extent
        d.kill()
        d = Daemon(tmp_path, name="rep2", dram="0", extra=extra).start()
        deadline = time.monotonic() + 10
        ext: list[list[int]] = []
        while time.monotonic() < deadline:
            try:
                ext = _extents(c, keys)
            except Exception:  # noqa: BLE001 - the client catches up with the new service
                time.sleep(0.1)
                continue
            if all(len(e) == 2 for e in ext):
                break
            time.sleep(0.1)
        assert all(sorted(c.addr.decode(g)[1] for g in e) == ranks for e in ext), ext
        assert c.info()["objects"] == len(keys) and c.info()["replica_extents"] == len(keys)
        worst = [0.0]
        assert _read_all(c, keys, worst) == (len(keys), 0)
    finally:
        _stop(owners, d, c)
