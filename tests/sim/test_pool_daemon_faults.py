"""The pool daemon under faults: a restart where a window-less client rejoins first,
racing daemons on one socket, SIGTERM at every start-up stage, a start whose directory
table does not fit. Each plants the fault and checks bytes, exit statuses and the
shared-memory directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from kvf_testing import segments
from pool_testing import Daemon, _die_with_parent, content

from kvfabric.errors import OutOfSpace, ServiceUnavailable
from kvfabric.platform import shm
from kvfabric.pool import connect
from kvfabric.pool.client import session as pool_session
from kvfabric.pool.client.api import PoolClient
from kvfabric.pool.config import PoolConfig
from kvfabric.pool.service import node as pool_node
from kvfabric.pool.service.node import PoolNode, StartStage
from kvfabric.pool.status import Status

KiB, MiB = 1 << 10, 1 << 20


def _spawn(d: Daemon, *flags: str) -> subprocess.Popen:
    """``kvfabric pool serve`` with ``d``'s config, not waited for (see ``Daemon.start``)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvfabric.cli", "pool", "serve", "--config", str(d.cfg), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ.copy(),
        preexec_fn=_die_with_parent,
    )
    d.proc = proc
    Daemon.started.append(d)
    return proc


def _event(proc: subprocess.Popen) -> dict:
    """The next JSON line the daemon prints ({} if it exited first)."""
    while True:
        line = proc.stdout.readline()
        if not line:
            return {}
        if line.startswith("{"):
            return json.loads(line)


def _leftovers(shm_dir: Path, sock_dir: Path) -> list[str]:
    """Everything a stopped daemon could have left: segments, lock files, sockets."""
    left = sorted(os.listdir(shm_dir))
    return left + sorted(n for n in os.listdir(sock_dir) if not n.endswith((".yaml", ".ranks")))


OWN = [f"own{i}" for i in range(30)]  # 100 KiB objects an owner with a window puts


def _owner_then_crash(
    tmp_path: Path, windowless: bool = True, forget_ranks: bool = False
) -> tuple[Daemon, PoolClient, PoolClient | None, set[str]]:
    """A daemon, an owner with a 2 MiB window that stored ``OWN`` (some in its own window,
    returned), optionally a window-less client; then SIGKILL the daemon (``forget_ranks``:
    and delete its rank file), let every client see it gone, and start the next daemon."""
    d = Daemon(tmp_path).start()
    owner = connect(d.socket, window_bytes=2 * MiB)
    other = connect(d.socket) if windowless else None
    assert (owner.batch_put(OWN, [content(k, 100 * KiB) for k in OWN]) == Status.OK).all()
    in_own = {k for k in OWN if owner.in_own_window(int(owner.table.lookup(k.encode()).gva))}
    assert in_own and len(in_own) < len(OWN)  # the fault needs objects in the owner's window
    d.kill()  # no cleanup: clients notice at their next call
    if forget_ranks:
        os.unlink(d.socket + ".ranks")
    for c in (owner, other):
        if c is not None:
            with pytest.raises(ServiceUnavailable):
                c.info()
    return Daemon(tmp_path).start(), owner, other, in_own


def _close_all(d: Daemon, shm_dir: Path, *clients: PoolClient | None) -> None:
    for c in clients:
        if c is not None:
            c.close()
    assert d.stop() == 0
    assert segments(shm_dir) == []


def test_a_windowless_client_rejoining_first_does_not_take_the_owners_rank(tmp_path, isolated_shm):
    d2, owner, other, in_own = _owner_then_crash(tmp_path)
    assert other is not None
    rank = owner.rank
    try:
        other.refresh()  # the window-less client rejoins first...
        assert other.rank != rank  # ...and is not given the rank reserved for the owner
        owner.refresh()
        assert owner.rank == rank
        for k in OWN:  # the owner's objects are readable, by both clients
            assert owner.get(k) == content(k, 100 * KiB)
        for k in in_own:
            assert other.get(k) == content(k, 100 * KiB)
        late = [f"late{i}" for i in range(30)]
        assert (owner.batch_put(late, [content(k, 50 * KiB) for k in late]) == Status.OK).all()
        assert all(other.get(k) == content(k, 50 * KiB) for k in late)
        assert other.put("other", b"x" * 1000) is Status.OK and owner.get("other") == b"x" * 1000
    finally:
        _close_all(d2, isolated_shm, owner, other)


def test_a_catch_up_that_fails_half_way_is_retried_on_the_next_call(tmp_path, isolated_shm, monkeypatch):
    d2, owner, _, _ = _owner_then_crash(tmp_path, windowless=False)
    rank = owner.rank
    real_join = pool_session.Fabric.join
    calls = []

    def join_fails_once(*args: object, **kwargs: object) -> object:
        calls.append(kwargs.get("rank"))
        if len(calls) == 1:  # the fault: the rejoin after the restart fails once
            raise ServiceUnavailable("injected: rendezvous not reachable")
        return real_join(*args, **kwargs)

    try:
        monkeypatch.setattr(pool_session.Fabric, "join", join_fails_once)
        with pytest.raises(ServiceUnavailable, match="injected"):
            owner.refresh()
        owner.refresh()  # the epoch was not recorded: this call catches up
        assert calls == [rank, rank] and owner.rank == rank
        assert all(owner.get(k) == content(k, 100 * KiB) for k in OWN)
        assert owner.put("after", b"z" * 5000) is Status.OK and owner.get("after") == b"z" * 5000
    finally:
        _close_all(d2, isolated_shm, owner)


def test_an_owner_whose_rank_was_taken_drops_its_objects_never_serves_wrong_bytes(tmp_path, isolated_shm):
    # the fault: no rank file, so nothing tells the next daemon to hold the owner's rank
    d2, owner, other, in_own = _owner_then_crash(tmp_path, forget_ranks=True)
    assert other is not None
    rank = owner.rank
    try:
        other.refresh()
        assert other.rank == rank  # unreserved, the lowest free rank went to the first to ask
        owner.refresh()  # its rank is held: it rejoins at another and drops its window's objects
        assert owner.rank != rank
        for k in OWN:
            for c in (owner, other):
                assert c.batch_get([k])[0] == (None if k in in_own else content(k, 100 * KiB))
        assert owner.put("after", content("after", 200 * KiB)) is Status.OK
        assert other.get("after") == content("after", 200 * KiB)
    finally:
        _close_all(d2, isolated_shm, owner, other)


def test_ten_racing_daemons_on_one_socket_one_runs_the_others_name_its_pid(tmp_path, isolated_shm):
    ds = [Daemon(tmp_path) for _ in range(10)]  # one config: same name, same socket
    procs = [_spawn(d) for d in ds]
    ready = [_event(p) for p in procs]
    winners = [p for p, r in zip(procs, ready) if r.get("event") == "ready"]
    assert len(winners) == 1, [p.stderr.read() for p in procs if p.poll() is not None]
    (win,) = winners
    assert ready[procs.index(win)]["pid"] == win.pid
    for p in procs:
        if p is not win:
            assert p.wait(60) == 2
            err = p.stderr.read()
            assert f"a pool daemon (pid {win.pid}) already serves {ds[0].socket}" in err, err
    # the losers removed nothing of the winner's and left nothing of their own
    names = segments(isolated_shm)
    assert len(names) == 2 and any(n.endswith("-window") for n in names), names
    c = connect(ds[0].socket)
    assert c.put("k", b"v" * 4096) is Status.OK and c.get("k") == b"v" * 4096
    c.close()
    win.send_signal(signal.SIGTERM)
    assert win.wait(30) == 0
    assert _leftovers(isolated_shm, tmp_path) == []


def test_a_second_pool_of_the_same_name_on_another_socket_is_refused(tmp_path, isolated_shm):
    a = Daemon(tmp_path).start()
    try:
        other_dir = tmp_path / "b"
        other_dir.mkdir()
        proc = _spawn(Daemon(other_dir))  # the same pool name "t", another socket
        assert _event(proc) == {} and proc.wait(60) == 2
        err = proc.stderr.read()
        assert f"a pool daemon (pid {a.proc.pid}) already runs pool 't'" in err, err
        assert len(segments(isolated_shm)) == 2  # the running pool's window and table, untouched
        c = connect(a.socket)
        assert c.put("k", b"v") is Status.OK and c.get("k") == b"v"
        c.close()
    finally:
        assert a.stop() == 0
    assert _leftovers(isolated_shm, tmp_path) == ["b"] and _leftovers(isolated_shm, other_dir) == []


@pytest.mark.parametrize("stage", list(StartStage), ids=lambda s: s.value)
def test_sigterm_at_each_start_up_stage_leaves_nothing(tmp_path, isolated_shm, stage):
    d = Daemon(tmp_path, dram="8MiB", extra={"pretouch": "true"})
    proc = _spawn(d, "--pause-at", stage.value)
    assert _event(proc) == {"event": "paused", "stage": stage.value}, proc.stderr.read()
    planted = segments(isolated_shm)
    if stage is not StartStage.LOCKED:
        assert any(n.endswith("-window") for n in planted)  # the start got as far as allocating
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 128 + signal.SIGTERM, proc.stderr.read()
    assert _leftovers(isolated_shm, tmp_path) == []


def test_sigterm_right_after_ready_stops_cleanly(tmp_path, isolated_shm):
    d = Daemon(tmp_path, dram="8MiB")
    proc = _spawn(d)
    assert _event(proc)["event"] == "ready"
    proc.send_signal(signal.SIGTERM)  # no pause: the very moment the ready line is out
    assert proc.wait(30) == 0
    assert _leftovers(isolated_shm, tmp_path) == []


def test_an_interrupted_restart_keeps_what_it_found_for_the_next_one(tmp_path, isolated_shm):
    d = Daemon(tmp_path, dram="8MiB").start()
    c = connect(d.socket)
    assert c.put("kept", content("kept", 300 * KiB)) is Status.OK
    c.close()
    d.kill()
    crashed = segments(isolated_shm)
    proc = _spawn(Daemon(tmp_path, dram="8MiB"), "--pause-at", StartStage.TABLE.value)
    assert _event(proc)["stage"] == "table" and len(segments(isolated_shm)) == 3
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 128 + signal.SIGTERM
    assert segments(isolated_shm) == crashed  # its own new table removed, the crashed pool kept
    d2 = Daemon(tmp_path, dram="8MiB").start()
    try:
        c = connect(d2.socket)
        assert c.get("kept") == content("kept", 300 * KiB)  # rebuilt from what was kept
        c.close()
    finally:
        assert d2.stop() == 0
    assert _leftovers(isolated_shm, tmp_path) == []


def test_a_restart_with_another_window_size_names_the_cause_and_keeps_the_window(tmp_path, isolated_shm):
    d = Daemon(tmp_path, dram="8MiB").start()
    d.kill()
    crashed = segments(isolated_shm)
    proc = _spawn(Daemon(tmp_path, dram="16MiB"))
    assert _event(proc) == {} and proc.wait(60) == 2
    err = proc.stderr.read()
    assert "exists with 8388608 B, not 16777216 B" in err and "start with that dram size" in err, err
    assert segments(isolated_shm) == crashed  # the earlier daemon's window and table, untouched
    assert Daemon(tmp_path, dram="8MiB").start().stop() == 0  # the same size recovers it
    assert _leftovers(isolated_shm, tmp_path) == []


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 16 MiB tmpfs as the shared-memory directory (needs mount rights: root)."""
    mnt = tmp_path / "shm"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_window_that_fits_with_a_table_that_does_not_leaks_nothing(tmp_path, small_tmpfs, monkeypatch):
    monkeypatch.setenv("KVFABRIC_SHM_DIR", str(small_tmpfs))
    sock_dir = tmp_path / "run"
    sock_dir.mkdir()
    d = Daemon(sock_dir, dram="8MiB", extra={"max_objects": 1 << 20, "pretouch": "false"})
    proc = _spawn(d)
    assert _event(proc) == {}
    assert proc.wait(60) == 2
    err = proc.stderr.read()
    assert "directory table for 1048576 objects does not fit" in err, err
    assert "B free" in err and "Traceback" not in err
    assert _leftovers(small_tmpfs, sock_dir) == []


def test_a_failed_table_allocation_in_process_removes_the_window(isolated_shm, tmp_path, monkeypatch):
    """The same fault injected at the table allocation, where no tmpfs can be mounted."""

    def no_room(*_a: object, **_k: object) -> None:
        assert any(n.endswith("-window") for n in segments(isolated_shm))  # the window exists now
        raise OutOfSpace("directory table for 1 objects does not fit: injected")

    monkeypatch.setattr(pool_node.tbl, "create", no_room)
    cfg = PoolConfig(name="inj", dram=4 * MiB, socket=str(tmp_path / "inj.sock"), pretouch=False)
    with pytest.raises(OutOfSpace, match="injected"):
        PoolNode(cfg, persistent=True)
    assert segments(isolated_shm) == [] and shm.owned_names() == []
