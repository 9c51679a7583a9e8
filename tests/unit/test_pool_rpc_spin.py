"""The RPC transport's short poll for a reply: it sees data that is there, gives up when
nothing comes, and a call with or without it gets the same replies from a real server."""

from __future__ import annotations

import socket
import threading
import time
from multiprocessing.connection import Connection

import pytest

from kvfabric.pool import protocol as p
from kvfabric.pool.client.rpc import SPIN_US, SocketTransport, spin_poll
from kvfabric.pool.service.server import RpcServer


def _pair() -> tuple[Connection, Connection]:
    a, b = socket.socketpair()
    return Connection(a.detach()), Connection(b.detach())


def test_spin_poll_sees_waiting_data_and_gives_up_without():
    a, b = _pair()
    try:
        t0 = time.perf_counter()
        assert spin_poll(a, 0.002) is False  # at the deadline, or earlier on a contended core
        assert time.perf_counter() - t0 < 1.0
        b.send_bytes(b"x")
        assert spin_poll(a, 0.5) is True
        assert a.recv_bytes() == b"x"
        late = threading.Timer(0.001, b.send_bytes, (b"y",))
        late.start()
        # data that arrives during the spin is seen by it, unless the sender's wake-up took
        # this core (then the spin gives up and the caller's blocking poll sees it)
        assert spin_poll(a, 1.0) or a.poll(5.0)
        assert a.recv_bytes() == b"y"
        late.join()
    finally:
        a.close()
        b.close()


def test_spin_gives_up_when_a_yield_shows_the_core_is_wanted(monkeypatch):
    import kvfabric.pool.client.rpc as rpc

    a, b = _pair()
    yields = [0]

    def slow_yield() -> None:  # another task ran on this core meanwhile
        yields[0] += 1
        time.sleep(0.001)

    monkeypatch.setattr(rpc.os, "sched_yield", slow_yield)
    try:
        t0 = time.perf_counter()
        assert spin_poll(a, 5.0) is False
        assert yields[0] == 1 and time.perf_counter() - t0 < 1.0  # one yield, not 5 s of them
    finally:
        a.close()
        b.close()


def test_spin_defaults_and_bounds(tmp_path):
    assert SocketTransport(str(tmp_path / "s.sock")).spin_s == pytest.approx(SPIN_US * 1e-6)
    assert SocketTransport("tcp://127.0.0.1:1").spin_s == 0.0  # may cross nodes: sleep at once
    assert SocketTransport(str(tmp_path / "s.sock"), spin_us=0).spin_s == 0.0
    with pytest.raises(ValueError, match="spin_us"):
        SocketTransport(str(tmp_path / "s.sock"), spin_us=-5)


class _Echo:
    """A stateful stand-in for the dispatcher: counts requests, answers Info."""

    epoch = 7

    def __init__(self) -> None:
        self.calls = 0
        self._lock = threading.Lock()

    def handle(self, req: object, pid: int = 0) -> p.Reply:
        with self._lock:
            self.calls += 1
            return p.Reply(self.epoch, data={"n": self.calls})


@pytest.mark.parametrize("server_spin_us,client_spin_us", [(0, 0), (100, 100), (100, 0)])
def test_calls_with_and_without_spinning(tmp_path, server_spin_us, client_spin_us):
    path = str(tmp_path / "rpc.sock")
    echo = _Echo()
    server = RpcServer(echo, path, spin_us=server_spin_us)  # type: ignore[arg-type]
    server.start()
    clients = [SocketTransport(path, timeout=5.0, spin_us=client_spin_us) for _ in range(3)]
    seen: list[list[int]] = [[] for _ in clients]

    def run(i: int) -> None:
        for _ in range(50):
            seen[i].append(clients[i].call(p.Info()).data["n"])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(clients))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert echo.calls == 150
        assert sorted(n for s in seen for n in s) == list(range(1, 151))  # no reply lost or mixed up
        assert all(s == sorted(s) for s in seen)
        assert server._serving == 0
    finally:
        for c in clients:
            c.close()
        server.stop()


def test_spin_governor_backs_off_under_preemption_and_tries_again(monkeypatch):
    import kvfabric.pool.service.server as server

    count = [0]
    monkeypatch.setattr(server, "_preemptions", lambda: count[0])
    g = server.SpinGovernor(limit=100, backoff=3)
    for _ in range(5):  # a quiet machine: spinning stays on
        count[0] += 10
        g.tick()
        assert g.allowed
    count[0] += 500  # preempted a lot while spinning: off for `backoff` ticks
    g.tick()
    assert not g.allowed
    for _ in range(2):
        count[0] += 5
        g.tick()
        assert not g.allowed
    count[0] += 5
    g.tick()
    assert g.allowed  # tried again
    count[0] += 500
    g.tick()
    assert not g.allowed


def test_real_preemption_counter_moves_forward():
    import kvfabric.pool.service.server as server

    a = server._preemptions()
    assert isinstance(a, int) and a >= 0 and server._preemptions() >= a
