"""The node-local pool daemon started on demand (``kvfabric.pool.autostart``): processes
racing to start it start exactly one; it exits once idle for its grace, removing its
segments and socket; with no grace it stays; killing the process tree that started it
leaves it; a daemon that cannot start is an error
with its log."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import psutil
import pytest
from daemon_exit import gone, wait_gone
from kvf_testing import segments

from kvfabric.pool import connect
from kvfabric.pool.autostart import AutoPool, PoolStartFailed, daemon_pid, ensure, probe

MiB = 1 << 20
RACERS = 4


@pytest.fixture
def runtime(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setenv("KVFABRIC_PLATFORM", "sim")
    return tmp_path


def _race(pool: AutoPool, env: dict, barrier, out) -> None:
    """Start or join at the barrier; stay a client until every racer has reported (so the
    idle exit cannot end one daemon before a slow racer looks)."""
    os.environ.update(env)
    barrier.wait()
    try:
        loc = ensure(pool)
        client = connect(loc.socket, name=pool.name, metadata_only=True)
    except BaseException as e:
        out.put(("error", repr(e), None))
        raise
    out.put((loc.started, loc.pid, client.info()["epoch"]))
    barrier.wait()
    client.close()


def test_racing_processes_start_exactly_one_daemon(runtime, isolated_shm):
    pool = AutoPool(name="race", dram=8 * MiB, exit_when_idle_s=1.0, platform="sim")
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(RACERS), ctx.Queue()
    env = {k: os.environ[k] for k in ("XDG_RUNTIME_DIR", "KVFABRIC_SHM_DIR", "KVFABRIC_PLATFORM")}
    procs = [ctx.Process(target=_race, args=(pool, env, barrier, out)) for _ in range(RACERS)]
    for p in procs:
        p.start()
    got = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    assert all(r[0] in (True, False) for r in got), got
    assert sum(1 for started, _, _ in got if started) == 1, got
    assert len({pid for _, pid, _ in got}) == 1 and len({epoch for _, _, epoch in got}) == 1, got
    pid = got[0][1]
    wait_gone(pid, pool.path)  # every racer has exited: the daemon goes after its grace
    assert segments(isolated_shm) == []


def test_daemon_exits_after_its_last_client_and_not_before(runtime, isolated_shm):
    pool = AutoPool(name="idle", dram=8 * MiB, exit_when_idle_s=1.0, platform="sim")
    loc = ensure(pool)
    assert loc.started and loc.pid == daemon_pid(loc.socket)
    client = connect(loc.socket, name="idle")
    try:
        client.put("k", b"v" * 100)
        time.sleep(3 * pool.exit_when_idle_s)  # a client connected: idle never starts
        assert not gone(loc.pid) and client.get("k") == b"v" * 100
        again = ensure(pool)
        assert not again.started and again.pid == loc.pid
    finally:
        client.close()
    wait_gone(loc.pid, loc.socket)
    assert segments(isolated_shm) == []
    assert ensure(pool).started  # the next one starts a fresh daemon
    wait_gone(daemon_pid(pool.path), pool.path)


def test_daemon_without_idle_grace_stays_until_sigterm(runtime, isolated_shm):
    pool = AutoPool(name="stay", dram=8 * MiB, exit_when_idle_s=0, platform="sim")
    loc = ensure(pool)
    try:
        time.sleep(1.5)
        assert probe(loc.socket) is not None
    finally:
        os.kill(loc.pid, signal.SIGTERM)
    wait_gone(loc.pid, loc.socket)
    assert segments(isolated_shm) == []


def _start_and_stay(pool: AutoPool, env: dict, out) -> None:
    """Start the daemon as a client of it, report, and stay until killed."""
    os.environ.update(env)
    loc = ensure(pool)
    client = connect(loc.socket, name=pool.name)
    client.put("kept", b"k" * 100)
    out.put(loc.pid)
    time.sleep(120)


def test_killing_the_starters_process_tree_leaves_the_daemon(runtime, isolated_shm):
    """vLLM force-kills an engine core and all its descendants when it does not stop in
    time: the daemon one of its workers started must not be among them (other engines on
    the node may share it), and must still exit after its grace once that client is gone."""
    pool = AutoPool(name="tree", dram=8 * MiB, exit_when_idle_s=1.0, platform="sim")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    env = {k: os.environ[k] for k in ("XDG_RUNTIME_DIR", "KVFABRIC_SHM_DIR", "KVFABRIC_PLATFORM")}
    starter = ctx.Process(target=_start_and_stay, args=(pool, env, out))
    starter.start()
    pid = out.get(timeout=60)
    tree = psutil.Process(starter.pid)
    doomed = [tree, *tree.children(recursive=True)]
    assert pid not in {p.pid for p in doomed}  # not a descendant of the process that started it
    for proc in doomed:
        proc.kill()
    starter.join(10)
    assert probe(pool.path) is not None and not gone(pid)  # it outlived its starter's tree
    wait_gone(pid, pool.path)  # and then exits: the killed client's connection is gone
    assert segments(isolated_shm) == []


def test_a_daemon_that_cannot_start_is_an_error_with_its_log(runtime):
    bad = AutoPool(name="bad", dram=8 * MiB, platform="no-such-platform")
    with pytest.raises(PoolStartFailed, match="exited with status"):
        ensure(bad)
    assert probe(bad.path) is None
