"""The rendezvous contract on both stores: the single-node server over a socket, and etcd."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import pytest
from etcd_server import etcd_binary, etcd_server

from kvfabric.errors import KeyNotFound, ServiceUnavailable
from kvfabric.pool.gva.rendezvous import connect
from kvfabric.pool.gva.rendezvous.base import Compacted
from kvfabric.pool.gva.rendezvous.collectives import Group
from kvfabric.pool.gva.rendezvous.etcd import EtcdStore
from kvfabric.pool.gva.rendezvous.server import RendezvousServer

TTL = 4.0  # roomy: a loaded 2-core machine can delay a heartbeat thread by seconds


@pytest.fixture(params=["local", "etcd"])
def url(request):
    if request.param == "local":
        with RendezvousServer(session_ttl=TTL) as srv:
            yield srv.url
    else:
        if etcd_binary() is None:
            pytest.skip("etcd binary not found: install Debian's etcd-server (.ci/run does)")
        with etcd_server() as u:
            yield u


def _client(url: str):
    return connect(url, ttl=TTL) if url.startswith("etcd") else connect(url)


def test_set_get_add_append_cas_delete_range(url):
    with _client(url) as s:
        s.set("p/a", b"1")
        assert s.get("p/a") == b"1" and s.try_get("p/none") is None
        with pytest.raises(KeyNotFound, match="p/none"):
            s.get("p/none", timeout=0.1)
        assert s.add("p/n", 5) == 5 and s.add("p/n", -2) == 3
        assert s.append("p/l", b"ab") == 2 and s.append("p/l", b"c") == 3 and s.get("p/l") == b"abc"
        assert s.cas("p/a", b"1", b"2") == (True, b"2")
        assert s.cas("p/a", b"1", b"3") == (False, b"2")
        assert s.cas("p/new", None, b"x") == (True, b"x") and s.cas("p/new", None, b"y") == (False, b"x")
        assert s.cas("p/new", b"x", None) == (True, None) and s.try_get("p/new") is None
        kvs, rev = s.range("p/")
        assert [kv.key for kv in kvs] == ["p/a", "p/l", "p/n"] and rev >= max(kv.revision for kv in kvs)
        assert s.delete("p/a") and not s.delete("p/a")
        assert s.delete_prefix("p/") == 2 and s.range("p/")[0] == []
        with pytest.raises(TypeError):
            s.set("k", "not bytes")  # type: ignore[arg-type]
        s.set("p/text", b"abc")
        with pytest.raises(ValueError, match="does not hold an integer"):
            s.add("p/text", 1)


def test_blocking_get_and_watch(url):
    with _client(url) as a, _client(url) as b:
        _, rev = a.range("w/")
        threading.Timer(0.3, lambda: b.set("w/late", b"v")).start()
        t0 = time.monotonic()
        assert a.get("w/late", timeout=10) == b"v"
        assert 0.2 < time.monotonic() - t0 < 5
        b.delete("w/late")
        evs, rev2 = a.watch("w/", rev, 5)
        assert [(e.key, e.value) for e in evs] == [("w/late", b"v"), ("w/late", None)] and rev2 >= evs[
            -1
        ].revision
        t0 = time.monotonic()
        assert a.watch("w/", rev2, 0.3)[0] == []
        assert time.monotonic() - t0 >= 0.25


def test_concurrent_adds_and_appends_are_atomic(url):
    clients = [_client(url) for _ in range(4)]
    try:

        def work(s, i):
            for _ in range(25):
                s.add("c/n", 1)
                s.append("c/l", bytes([i]))

        ts = [threading.Thread(target=work, args=(s, i)) for i, s in enumerate(clients)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert clients[0].get("c/n") == b"100"
        data = clients[0].get("c/l")
        assert sorted(data) == sorted(bytes(range(4)) * 25)
    finally:
        for s in clients:
            s.close()


def test_ephemeral_keys_go_with_their_session(url):
    with _client(url) as watcher:
        s = _client(url)
        s.set("e/mine", b"1", ephemeral=True)
        s.set("e/kept", b"1")
        _, rev = watcher.range("e/")
        s.close()
        evs, _ = watcher.watch("e/", rev, 10)
        assert [(e.key, e.value) for e in evs] == [("e/mine", None)]
        assert watcher.get("e/kept") == b"1"


def test_a_killed_process_loses_its_ephemeral_keys(url):
    code = textwrap.dedent(f"""
        import time
        from kvfabric.pool.gva.rendezvous import connect
        s = connect({url!r}, **({{"ttl": {TTL}}} if {url!r}.startswith("etcd") else {{}}))
        s.set("k/child", b"alive", ephemeral=True)
        print("ready", flush=True)
        time.sleep(600)
    """)
    with _client(url) as watcher:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "ready"
            kv = watcher.try_get("k/child")
            assert kv is not None
            proc.kill()
            t0 = time.monotonic()
            evs, _ = watcher.watch("k/", kv.revision, TTL + 5)
            assert evs and evs[0].value is None
            assert time.monotonic() - t0 < TTL + 3
        finally:
            proc.kill()
            proc.wait()


def test_barrier_and_all_gather_clean_up_their_keys(url):
    world = 4
    out: dict[int, list] = {}
    errors = []

    def member(rank):
        try:
            with _client(url) as s:
                g = Group(s, "coll/g", rank, world, timeout=20)
                g.barrier()
                out[rank] = [g.all_gather(f"r{rank}".encode()), g.all_gather(bytes(rank))]
                g.barrier()
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=member, args=(r,)) for r in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors
    for r in range(world):
        assert out[r][0] == [f"r{i}".encode() for i in range(world)]
        assert out[r][1] == [bytes(i) for i in range(world)]
    with _client(url) as s:
        assert s.range("coll/")[0] == []
        with pytest.raises(ServiceUnavailable, match="1 of 2"):
            Group(s, "coll/lonely", 0, 2, timeout=0.3).all_gather(b"x")


def test_local_server_compaction_and_bad_addresses():
    with RendezvousServer(history=16) as srv, connect(srv.url) as s:
        for i in range(40):
            s.set(f"h/{i}", b"v")
        with pytest.raises(Compacted):
            s.watch("h/", 1, 1)
    with pytest.raises(ValueError, match="kvf://HOST:PORT"):
        connect("kvf://nohost")
    with pytest.raises(ValueError, match="unknown rendezvous scheme"):
        connect("redis://127.0.0.1:1")
    with pytest.raises(ServiceUnavailable, match="cannot reach"):
        connect("kvf://127.0.0.1:1")


def test_unix_socket_server(tmp_path):
    path = str(tmp_path / "rdv.sock")
    with RendezvousServer(unix_path=path) as srv, connect(srv.url) as s:
        assert srv.url == f"kvf+unix://{path}"
        s.set("u", b"1")
        assert s.get("u") == b"1"


def test_a_hung_process_loses_its_session_after_the_ttl():
    """SIGSTOP: the socket stays open, the heartbeats stop; after ttl the server probes, after
    the grace it finds the process stopped in /proc and drops the session."""
    import os
    import signal

    with RendezvousServer(session_ttl=2.0) as srv, connect(srv.url) as watcher:
        code = textwrap.dedent(f"""
            import time
            from kvfabric.pool.gva.rendezvous import connect
            s = connect({srv.url!r})
            s.set("hung/child", b"alive", ephemeral=True)
            print("ready", flush=True)
            time.sleep(600)
        """)
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "ready"
            kv = watcher.try_get("hung/child")
            time.sleep(2.5)  # heartbeats keep a live session beyond its ttl
            assert watcher.try_get("hung/child") is not None
            os.kill(proc.pid, signal.SIGSTOP)
            evs, _ = watcher.watch("hung/", kv.revision, 10)
            assert evs and evs[0].value is None
        finally:
            proc.kill()
            proc.wait()


class _FlakyLease(EtcdStore):
    """A real etcd client whose next ``fail`` lease keep-alives fail as a slow request would."""

    fail = 0

    def _post(self, path, body):
        if path == "/v3/lease/keepalive" and self.fail > 0:
            self.fail -= 1
            raise ServiceUnavailable(f"etcd at {self.url}: {path} failed: timed out (planted)")
        return super()._post(path, body)


def test_a_failed_etcd_keepalive_is_retried_not_a_lost_session():
    if etcd_binary() is None:
        pytest.skip("etcd binary not found: install Debian's etcd-server (.ci/run does)")
    with etcd_server() as u, _client(u) as watcher:
        s = _FlakyLease(u, ttl=TTL)
        try:
            s.set("flaky/k", b"1", ephemeral=True)
            s.fail = 3  # three in a row: well inside the ttl with retries every 0.4 s
            deadline = time.monotonic() + 30
            while s.fail and time.monotonic() < deadline:
                time.sleep(0.05)
            assert s.fail == 0, "the keep-alive thread stopped after a failure"
            time.sleep(TTL / 2)  # renewals after the failures carry the lease on
            assert not s.session_lost and watcher.try_get("flaky/k") is not None
            s.fail = 10**9  # now none succeeds: lost once the lease can have expired
            deadline = time.monotonic() + 30
            while not s.session_lost and time.monotonic() < deadline:
                time.sleep(0.05)
            with pytest.raises(ServiceUnavailable, match="keep-alive failed"):
                s.set("flaky/after", b"1")
        finally:
            s.fail = 0
            s.close()
