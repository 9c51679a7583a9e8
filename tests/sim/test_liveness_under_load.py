"""Liveness under CPU contention: live ranks keep their sessions, dead and hung ones do not.

Every test plants the starvation itself: busy-loop processes on every core (``CpuHog``),
a rank whose only interpreter lock is held by one long C call (``hold_gil``) or spun by a
pure-Python loop, a server whose own process holds its GIL, a client that never sends a
keep-alive. Then it checks the store's keys and the segment table, and, where the fix is
what saves the session, that the server's log shows the path it took.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cpuhog import CpuHog, hold_gil

from kvfabric.errors import RankUnavailable, ServiceUnavailable
from kvfabric.pool.gva import membership
from kvfabric.pool.gva.config import GvaConfig
from kvfabric.pool.gva.fabric import Fabric, FabricState, MembershipChange
from kvfabric.pool.gva.rendezvous import connect
from kvfabric.pool.gva.rendezvous.client import RendezvousClient
from kvfabric.pool.gva.rendezvous.protocol import BEAT, DECODER, HEADER, PROBE_TAG, frame
from kvfabric.pool.gva.rendezvous.server import RendezvousServer

SUPPORT = str(Path(__file__).resolve().parents[1] / "support")
TTL = 2.0  # below the old default of 3 s: the fix must not depend on a roomy ttl
NS = GvaConfig().namespace

_CHILD = """
import sys, time
sys.path.insert(0, {support!r})
from cpuhog import busy_python, hold_gil
url, kind = sys.argv[1], sys.argv[2]
if kind == "rank":
    from kvfabric.pool.gva.fabric import Fabric
    fab = Fabric.join(url, "sim", {{"dram": 1 << 20}})
    store, who = fab.store, fab.rank
else:
    from kvfabric.pool.gva.rendezvous import connect
    fab, store = None, connect(url)
    store.set("live/" + str(store.session), b"1", ephemeral=True)
    who = store.session
print("joined", who, flush=True)
for line in sys.stdin:
    cmd, _, arg = line.strip().partition(" ")
    if cmd in ("gil", "gil-blocked"):
        print("held", hold_gil(float(arg), busy=cmd == "gil"), flush=True)
    elif cmd == "python":
        print("spun", busy_python(float(arg)), flush=True)
    elif cmd == "state":  # wait up to arg seconds for the rank to be evicted / the session lost
        end = time.monotonic() + float(arg)
        state = lambda: fab.state.value if fab else ("lost" if store.session_lost else "ok")
        while state() in ("joined", "ok") and time.monotonic() < end:
            time.sleep(0.05)
        print("state", state(), flush=True)
    elif cmd == "leave":
        break
if fab is not None:
    fab.leave()
else:
    store.close()
print("left", flush=True)
"""


class Child:
    """A rank (``kind="rank"``: a Fabric with a 1 MiB window) or a bare store client
    (``kind="client"``: one ephemeral key ``live/{session}``) in its own interpreter."""

    def __init__(self, url: str, kind: str = "rank") -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD.format(support=SUPPORT), url, kind],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.id = -1

    def joined(self, timeout: float = 60.0) -> Child:
        word, value = self.line(timeout).split()
        assert word == "joined", word
        self.id = int(value)
        return self

    def send(self, cmd: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()

    def line(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"child {self.proc.pid} said nothing within {timeout} s")
        out = self.proc.stdout.readline()
        if not out:
            raise EOFError(f"child {self.proc.pid} exited (rc {self.proc.poll()})")
        return out.strip()

    def ask(self, cmd: str, timeout: float = 60.0) -> str:
        self.send(cmd)
        return self.line(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _start(url: str, n: int, kind: str = "rank") -> list[Child]:
    children = [Child(url, kind) for _ in range(n)]
    try:
        return [c.joined() for c in children]
    except BaseException:
        for c in children:
            c.stop()
        raise


def _observe(url: str) -> tuple[Fabric, list[MembershipChange]]:
    observer = Fabric.join(url, "sim")  # metadata-only, in the test process (and its server)
    changes: list[MembershipChange] = []
    observer.subscribe(changes.append)
    return observer, changes


def _departed(changes: list[MembershipChange]) -> list[int]:
    return [r for c in changes for r in c.left]


@pytest.fixture
def hog(cpu_hog_from_env):
    """Four busy loops (two per core here), or the session's own hog when
    ``KVFABRIC_TEST_CPU_HOG=1`` already runs one (not both: the test would only get slower)."""
    if cpu_hog_from_env is not None:
        yield cpu_hog_from_env
        return
    with CpuHog(4) as h:
        yield h


def test_live_ranks_keep_their_sessions_while_starved(hog, caplog):
    """4 busy loops on 2 cores; for 3x the ttl (2x the old default) one rank's GIL is held by a
    C call blocked in the kernel, one's by a C call on the CPU, and one spins in Python.
    Nobody leaves the table; no alive key goes."""
    caplog.set_level(logging.INFO, "kvfabric.gva.rendezvous")
    with RendezvousServer(session_ttl=TTL, max_silence=60.0) as srv:
        ranks = _start(srv.url, 3)
        observer, changes = _observe(srv.url)
        try:
            observer.wait_for(lambda t: len(t.members) == 4, 30)
            with connect(srv.url) as watcher:
                _, rev = watcher.range(membership.alive_prefix(NS))
                blocked, busy, spin = ranks
                blocked.send(f"gil-blocked {3 * TTL}")
                busy.send(f"gil {3 * TTL}")
                spin.send(f"python {3 * TTL}")
                held = float(blocked.line(120).split()[1])
                held_busy = float(busy.line(120).split()[1])
                spin.line(120)
                assert held >= 3 * TTL - 0.1 and held_busy >= TTL, (held, held_busy)
                assert hog.running() == len(hog.pids) > 0, "the busy loops died: nothing was contended"
                time.sleep(TTL)  # one more ttl of ordinary heartbeats after the starvation
                evs, _ = watcher.watch(membership.alive_prefix(NS), rev, 0.1)
            assert [e.key for e in evs if e.value is None] == [], "an alive key was deleted"
            assert _departed(changes) == []
            assert sorted(observer.table.ranks) == sorted([observer.rank, *(r.id for r in ranks)])
            for r in ranks:
                assert r.ask("state 0") == "state joined"
            kept = [m for m in caplog.messages if "kept" in m and f"process {blocked.proc.pid} " in m]
            assert kept, "the GIL-bound rank was never silent long enough to be probed: nothing was tested"
        finally:
            observer.leave()
            for r in ranks:
                r.stop()


def test_a_stopped_rank_is_evicted_after_the_grace_and_learns_it(hog):
    with RendezvousServer(session_ttl=TTL, max_silence=60.0) as srv:
        ranks = _start(srv.url, 2)
        observer, changes = _observe(srv.url)
        try:
            observer.wait_for(lambda t: len(t.members) == 3, 30)
            hung, other = ranks
            os.kill(hung.proc.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            observer.wait_for(lambda t: hung.id not in t.ranks, 30)  # 30 s < max_silence: not the cap
            silent = time.monotonic() - t0
            # the last beat came at most ttl/3 before the stop; the drop needs ttl of silence first
            assert silent >= TTL * 2 / 3 - 0.05, f"dropped after {silent:.2f} s of silence"
            assert _departed(changes) == [hung.id] and other.id in observer.table.ranks
            os.kill(hung.proc.pid, signal.SIGCONT)
            assert hung.ask("state 30") == "state evicted"
            assert other.ask("state 0") == "state joined"
        finally:
            observer.leave()
            for r in ranks:
                r.stop()


def test_a_killed_rank_is_evicted_by_its_closed_socket_not_by_silence(hog):
    """ttl 30 s: an eviction well before it can only come from the connection closing."""
    with RendezvousServer(session_ttl=30.0) as srv:
        ranks = _start(srv.url, 2)
        observer, changes = _observe(srv.url)
        try:
            observer.wait_for(lambda t: len(t.members) == 3, 30)
            dead, other = ranks
            dead.proc.kill()
            observer.wait_for(lambda t: dead.id not in t.ranks, 15)
            assert dead.id not in observer.table.ranks and other.id in observer.table.ranks
            assert _departed(changes) == [dead.id]
        finally:
            observer.leave()
            for r in ranks:
                r.stop()


def test_a_server_whose_own_gil_is_held_drops_nobody(caplog):
    """The server shares its process with a thread that holds the GIL for 4x the ttl (the
    pool daemon copying): its clients kept beating into the socket, so nobody was silent."""
    caplog.set_level(logging.INFO, "kvfabric.gva.rendezvous")
    with RendezvousServer(session_ttl=1.0, probe_grace=1.0) as srv, connect(srv.url) as watcher:
        (child,) = _start(srv.url, 1, kind="client")
        try:
            key = f"live/{child.id}"
            kv = watcher.try_get(key)
            assert kv is not None
            assert hold_gil(4.0, busy=False) >= 3.9
            time.sleep(2.0)  # the loop catches up: reads the queued beats, judges again
            evs, _ = watcher.watch("live/", kv.revision, 0.1)
            assert evs == [] and watcher.try_get(key) is not None
            assert child.ask("state 0") == "state ok"
            assert not [m for m in caplog.messages if "dropped" in m]
        finally:
            child.stop()


def _raw_session(url: str, hello: list) -> socket.socket:
    host, _, port = url[len("kvf://") :].rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(frame([1, "hello", *hello]))
    _recv_frame(sock)
    sock.sendall(frame([2, "set", "raw/k", b"1", True]))
    assert _recv_frame(sock)[1] is True
    return sock


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _recv_frame(sock: socket.socket) -> list | None:
    """One frame, or None when the server closed the connection."""
    head = _recv_exact(sock, HEADER.size)
    body = None if head is None else _recv_exact(sock, HEADER.unpack(head)[0])
    return None if body is None else DECODER.decode(body)


@pytest.mark.parametrize("hello", [[], [1]], ids=["no-pid", "claims-pid-1"])
def test_a_silent_peer_is_kept_by_answering_probes_and_dropped_when_it_stops(hello):
    """A client that never sends a keep-alive but answers every probe keeps its session; once it
    stops answering, a peer whose process cannot be seen (no pid, or a pid that does not hold
    the connection) is dropped after ttl + grace."""
    with RendezvousServer(session_ttl=1.0, probe_grace=1.0) as srv, connect(srv.url) as watcher:
        sock = _raw_session(srv.url, hello)
        with sock:
            probes, end = 0, time.monotonic() + 4.0
            while time.monotonic() < end:
                msg = _recv_frame(sock)
                assert msg is not None, "dropped although every probe was answered"
                if msg[0] == 0 and msg[2] == PROBE_TAG:
                    probes += 1
                    sock.sendall(BEAT)
            assert probes >= 2 and watcher.try_get("raw/k") is not None
            while (msg := _recv_frame(sock)) is not None:  # now silent: the server must hang up
                assert msg[2] == PROBE_TAG
        assert watcher.try_get("raw/k") is None


def test_a_live_process_that_stays_silent_past_max_silence_is_dropped():
    """Alive is not forever: a process whose GIL stays held past ``max_silence`` is dropped
    (its keys go) while it still runs, and finds its session lost when it gets the GIL back."""
    with RendezvousServer(session_ttl=1.0, probe_grace=1.0, max_silence=3.0) as srv, connect(srv.url) as w:
        (child,) = _start(srv.url, 1, kind="client")
        try:
            kv = w.try_get(f"live/{child.id}")
            assert kv is not None
            child.send("gil-blocked 6")
            evs, _ = w.watch("live/", kv.revision, 30)
            assert [e.value for e in evs] == [None] and child.proc.poll() is None
            assert child.line(60).startswith("held")
            assert child.ask("state 10") == "state lost"
        finally:
            child.stop()


class _FlakyClient(RendezvousClient):
    """A real client whose next ``fail`` watches raise as a reply that came too late would."""

    fail = 0

    def watch(self, prefix, after, timeout):
        if self.fail > 0:
            self.fail -= 1
            raise ServiceUnavailable(f"{self.url}: no reply to watch within {timeout} s (planted)")
        return super().watch(prefix, after, timeout)


def test_a_late_reply_is_not_an_eviction_but_a_lost_session_is():
    with RendezvousServer(session_ttl=TTL) as srv:
        store = _FlakyClient(srv.url)
        a = Fabric.join(store, "sim", {"dram": 1 << 20})
        try:
            store.fail = 3
            b = Fabric.join(srv.url, "sim", {"dram": 1 << 20})
            try:
                for _ in range(600):  # the monitor calls watch about once per period
                    if store.fail == 0:
                        break
                    time.sleep(0.05)
                assert store.fail == 0, "the monitor stopped calling watch after a failure"
                a.wait_for(lambda t: b.rank in t.ranks, 30)
                assert a.state is FabricState.JOINED
            finally:
                b.leave()
            srv.close()  # the connection closes: that session is lost for real
            with pytest.raises(RankUnavailable, match="session lost"):
                a.wait_for(lambda _t: False, 30)  # returns (raising) once this rank is evicted
            assert a.state is FabricState.EVICTED
        finally:
            a.leave()
            store.close()
