"""The meta service's leadership through etcd: real etcd, real daemon subprocesses (each
with a shared-memory directory of its own, so each is a node of its own as far as the pool
can tell), real TCP sockets on 127.0.0.1.

* three daemons campaign, exactly one leads; the leader is killed (SIGKILL) and another
  leads within a bounded time (``failover_s``, printed) while a client keeps calling
  through the change: no call blocks 2 s, no read returns wrong bytes, and once the new
  leader serves, every object the client's window holds is readable again (re-registered);
* a leader stopped (SIGSTOP) until another took over grants nothing when it resumes (its
  allocation and commit are refused, no object of it becomes readable) and steps down;
* the fail-closed gate itself: a leader whose local deadline passed grants nothing while it
  still believes it leads (a clock stopped at will, a real etcd); a leader whose etcd goes
  away stops granting by its deadline and steps down.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from etcd_server import etcd_binary, etcd_server
from pool_testing import Daemon, campaigning_daemons, content

from kvfabric.errors import KeyNotFound, ServiceUnavailable
from kvfabric.pool import EmbeddedPool, PoolConfig, connect
from kvfabric.pool import protocol as p
from kvfabric.pool.client.leader import LeaderRecord, read_leader
from kvfabric.pool.client.rpc import SocketTransport
from kvfabric.pool.gva.rendezvous.etcd import EtcdStore
from kvfabric.pool.service.leader import Campaign, LeaderState
from kvfabric.pool.status import Status

needs_etcd = pytest.mark.skipif(etcd_binary() is None, reason="etcd not installed (etcd-server)")

TOKEN = "s3cret-pool-token"
TTL = 2  # s: the leader's etcd lease in these tests
KiB = 1 << 10


@pytest.fixture(scope="module")
def etcd():
    with etcd_server() as url:
        yield url


def _daemons(tmp: Path, shm: Path, etcd: str, pool: str, n: int) -> list[Daemon]:
    """``n`` daemons of pool ``pool``, each a node of its own (shared-memory directory)."""
    return campaigning_daemons(tmp, shm, etcd, pool, n, TOKEN, leader_ttl_s=TTL, write_lease_s=1.0)


def _info(d: Daemon) -> dict:
    t = SocketTransport(f"tcp://127.0.0.1:{d.ready['tcp_port']}", timeout=1.0, token=TOKEN)
    try:
        return t.call(p.Info()).data
    finally:
        t.close()


def _state(d: Daemon) -> str:
    try:
        return _info(d)["leader"]["state"]
    except ServiceUnavailable:
        return "unreachable"


def _wait_leader(ds: list[Daemon], timeout: float = 15.0) -> Daemon:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        live = [d for d in ds if d.proc is not None and d.proc.poll() is None]
        leaders = [d for d in live if _state(d) == "leader"]
        if leaders:
            assert len(leaders) == 1, f"{len(leaders)} daemons lead at once"
            return leaders[0]
        time.sleep(0.05)
    raise TimeoutError("no daemon leads")


def _stop_all(ds: list[Daemon]) -> None:
    for d in ds:
        if d.proc is not None and d.proc.poll() is None:
            d.proc.send_signal(signal.SIGCONT)
            d.stop()


class _Caller(threading.Thread):
    """Reads the client's objects and writes new ones in a loop, timing every call."""

    def __init__(self, client, keys: list[str], size: int) -> None:
        super().__init__(daemon=True)
        self.c, self.keys, self.size = client, keys, size
        self.stop = threading.Event()
        self.max_s = 0.0
        self.wrong = 0
        self.unavailable = 0  # calls that found no leader within their retry time
        self.last_full_read = 0.0  # monotonic time of the last round that read every key
        self.puts_ok = 0
        self.error: BaseException | None = None

    def _timed(self, fn, *args):
        t0 = time.monotonic()
        try:
            return fn(*args)
        finally:
            self.max_s = max(self.max_s, time.monotonic() - t0)

    def run(self) -> None:
        i = 0
        try:
            while not self.stop.is_set():
                got = 0
                for k in self.keys:
                    try:
                        value = self._timed(self.c.get, k)
                    except ServiceUnavailable:
                        self.unavailable += 1
                        continue
                    except KeyNotFound:  # not re-registered yet: a miss, never wrong bytes
                        continue
                    self.wrong += value != content(k, self.size)
                    got += 1
                if got == len(self.keys):
                    self.last_full_read = time.monotonic()
                i += 1
                try:
                    st = self._timed(self.c.batch_put, [f"new/{i}"], [content(f"new/{i}", self.size)])
                    self.puts_ok += int(st[0] == Status.OK)
                except ServiceUnavailable:
                    self.unavailable += 1
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e


@needs_etcd
def test_one_of_three_leads_and_a_killed_leader_is_replaced_while_a_client_keeps_calling(
    etcd, tmp_path, isolated_shm
):
    ds = _daemons(tmp_path, isolated_shm, etcd, "lead3", 3)
    try:
        leader = _wait_leader(ds)
        assert sorted(_state(d) for d in ds) == ["leader", "standby", "standby"]
        store = EtcdStore(etcd)
        try:
            rec = read_leader(store, "lead3")
        finally:
            store.close()
        assert rec is not None and rec.rpc == f"127.0.0.1:{leader.ready['tcp_port']}"
        assert rec.pid == leader.ready["pid"]

        size = 4 * KiB
        keys = [f"obj/{i}" for i in range(40)]
        c = connect(etcd=etcd, name="lead3", token=TOKEN, window_bytes=4 << 20, timeout=1.0)
        try:
            time.sleep(1.1)  # the new leader's allocation grace (write_lease_s)
            assert all(s == Status.OK for s in c.batch_put(keys, [content(k, size) for k in keys]))
            caller = _Caller(c, keys, size)
            caller.start()
            time.sleep(0.3)
            t_kill = time.monotonic()
            leader.kill()
            rest = [d for d in ds if d is not leader]
            new = _wait_leader(rest, timeout=15)
            failover_s = time.monotonic() - t_kill
            deadline = time.monotonic() + 10
            while caller.last_full_read <= t_kill + failover_s and time.monotonic() < deadline:
                time.sleep(0.05)
            served_s = caller.last_full_read - t_kill
            put_before = caller.puts_ok
            time.sleep(1.5)  # past the new leader's grace: puts go through again
            caller.stop.set()
            caller.join(10)
            assert caller.error is None, caller.error
            print(
                f"\nfailover_s={failover_s:.2f} reads_served_again_s={served_s:.2f} "
                f"max_call_s={caller.max_s:.2f} unavailable_calls={caller.unavailable} "
                f"puts_after_grace={caller.puts_ok - put_before}"
            )
            assert failover_s < TTL + 3.0
            assert caller.wrong == 0
            assert caller.max_s < 2.0, f"a call blocked {caller.max_s:.2f} s"
            assert caller.last_full_read > t_kill + failover_s, "objects not readable after the failover"
            assert caller.puts_ok > put_before, "no put went through the new leader"
            assert c.session.transport.leader == f"127.0.0.1:{new.ready['tcp_port']}"
            assert [c.get(k) == content(k, size) for k in keys] == [True] * len(keys)
        finally:
            c.close()
    finally:
        _stop_all(ds)


@needs_etcd
def test_a_stopped_leader_resumed_after_a_takeover_grants_nothing_and_steps_down(
    etcd, tmp_path, isolated_shm
):
    ds = _daemons(tmp_path, isolated_shm, etcd, "stop2", 2)
    try:
        old = _wait_leader(ds)
        (other,) = [d for d in ds if d is not old]
        time.sleep(1.1)  # its allocation grace
        t = SocketTransport(f"tcp://127.0.0.1:{old.ready['tcp_port']}", timeout=1.0, token=TOKEN)
        c = connect(etcd=etcd, name="stop2", token=TOKEN, window_bytes=1 << 20)
        try:
            assert c.put("before", b"x" * 100) == Status.OK  # the client's window joined: space to grant
            r = t.call(p.Alloc("w", [b"in-flight"], [64]))
            assert r.status == [Status.OK]
            os.kill(old.proc.pid, signal.SIGSTOP)
            assert _wait_leader([other], timeout=15) is other
            os.kill(old.proc.pid, signal.SIGCONT)
            late = t.call_unchecked(p.Alloc("w", [b"late"], [64]))  # at once, before it may learn
            assert late.error.startswith(p.NOT_LEADER) and not late.status, late
            commit = t.call_unchecked(p.Commit("w", [b"in-flight"], [True]))
            assert commit.error.startswith(p.NOT_LEADER) and not commit.status, commit
            deadline = time.monotonic() + 10
            while _state(old) != "standby" and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _state(old) == "standby" and _state(other) == "leader"
            assert not c.batch_exists([b"in-flight", b"late"]).any()
            with pytest.raises(KeyNotFound):
                c.get(b"in-flight")
            assert c.get("before") == b"x" * 100  # re-registered with the new leader
        finally:
            t.close()
            c.close()
    finally:
        _stop_all(ds)


@needs_etcd
def test_a_leader_past_its_local_deadline_grants_nothing_before_it_learns(etcd):
    """The gate checks the local deadline, not the state: with the campaign's clock moved
    past the lease's end, ``may_grant`` is False although the state still says LEADER."""
    now = [1000.0]
    elected = threading.Event()
    store = EtcdStore(etcd, call_timeout=1.0)
    rec = LeaderRecord("127.0.0.1:1", os.getpid(), "n", time.time()).encode()
    camp = Campaign(store, "gate1", rec, TTL, elected.set, lambda why: None, clock=lambda: now[0])
    camp.start()
    try:
        assert elected.wait(10)
        deadline = time.monotonic() + 5
        while camp.state is not LeaderState.LEADER and time.monotonic() < deadline:
            time.sleep(0.01)
        assert camp.may_grant() and camp.state is LeaderState.LEADER
        now[0] += TTL - camp.margin  # as if this process had been frozen until the deadline
        assert camp.state is LeaderState.LEADER and not camp.may_grant()
    finally:
        camp.stop()
    follower = EtcdStore(etcd)
    try:
        assert read_leader(follower, "gate1") is None  # stop() gave the key up at once
    finally:
        follower.close()


@needs_etcd
def test_a_leader_that_loses_etcd_stops_granting_by_its_deadline_and_steps_down():
    deposed: list[str] = []
    with etcd_server() as url:
        store = EtcdStore(url, call_timeout=0.5)
        rec = LeaderRecord("127.0.0.1:1", os.getpid(), "n", time.time()).encode()
        camp = Campaign(store, "lost1", rec, TTL, lambda: None, deposed.append).start()
        try:
            deadline = time.monotonic() + 10
            while not camp.may_grant() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert camp.may_grant()
            etcd_proc = _etcd_process(url)
            os.kill(etcd_proc, signal.SIGSTOP)  # etcd unreachable: no keep-alive gets through
            t0 = time.monotonic()
            try:
                while camp.may_grant() and time.monotonic() < t0 + 5:
                    time.sleep(0.01)
                stopped_granting = time.monotonic() - t0
                while camp.state is LeaderState.LEADER and time.monotonic() < t0 + 8:
                    time.sleep(0.05)
            finally:
                os.kill(etcd_proc, signal.SIGCONT)
            assert stopped_granting <= TTL - camp.margin + 0.1, stopped_granting
            assert camp.state is LeaderState.STANDBY and deposed and "etcd unreachable" in deposed[0]
        finally:
            camp.stop()


def _etcd_process(url: str) -> int:
    """The pid of the etcd serving ``url`` (the one listening on its port)."""
    port = url.rsplit(":", 1)[1]
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmd and cmd[0].endswith(b"etcd") and any(a.endswith(f":{port}".encode()) for a in cmd):
            return int(pid)
    raise LookupError(f"no etcd process serves {url}")


def test_a_new_term_starts_from_an_empty_directory_under_a_new_epoch(isolated_shm):
    """What election and deposition do to the node's directory (``_fresh_directory``): every
    entry goes (also those a removal shifts back onto a slot already passed), the count is
    0, the epoch is new, the windows stay, and the next puts are placed as before."""
    with EmbeddedPool(PoolConfig(name="fresh", dram="8MiB", max_objects=64, pretouch=False)) as pool:
        c = pool.client()
        try:
            keys = [f"k{i}" for i in range(50)]  # a small table: long clusters to shift back
            assert all(s == Status.OK for s in c.batch_put(keys[:20], [b"v" * 100] * 20))
            st, _ = c.batch_alloc(keys[20:], [100] * 30)  # being written: not readable, in the table
            assert all(s == Status.OK for s in st)
            epoch, windows = pool.dispatcher.epoch, set(pool.service.windows)
            with pool.dispatcher.lock:
                pool._fresh_directory()
            assert pool.table.count == 0 and not (pool.table.slots["hash"] != 0).any()
            assert pool.dispatcher.epoch != epoch and pool.table.epoch == pool.dispatcher.epoch
            assert set(pool.service.windows) == windows and pool.dispatcher.service is pool.service
            assert not c.batch_exists(keys).any()
            assert c.put("after", b"w" * 100) == Status.OK and c.get("after") == b"w" * 100
        finally:
            c.close()
