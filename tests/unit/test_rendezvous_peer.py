"""peer.py: the rendezvous server's look at the process behind a connection (real sockets, /proc)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from kvfabric.pool.gva.rendezvous.peer import ProcState, peer_pid, process_state

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs Linux /proc")


def test_process_state_tells_running_stopped_and_dead_apart():
    assert process_state(os.getpid()) is ProcState.RUNNING  # reading its own stat: on a CPU
    assert process_state(None) is ProcState.UNKNOWN and process_state(0) is ProcState.UNKNOWN
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(child.pid, signal.SIGSTOP)
        for _ in range(5000):  # the stop is asynchronous: poll until the kernel reports it
            if process_state(child.pid) is ProcState.STOPPED:
                break
            time.sleep(0.002)
        assert process_state(child.pid) is ProcState.STOPPED and not ProcState.STOPPED.alive
        os.kill(child.pid, signal.SIGCONT)
        child.kill()
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # dead, not yet reaped: a zombie
        assert process_state(child.pid) is ProcState.DEAD
    finally:
        child.kill()
        child.wait()
    assert process_state(child.pid) is ProcState.DEAD  # reaped: no such process


def test_unix_peer_is_named_by_the_kernel():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        assert peer_pid(a, claimed=1) == os.getpid()  # SO_PEERCRED wins over any claim


def test_a_tcp_claim_is_believed_only_from_the_process_that_holds_the_connection():
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        cli = socket.create_connection(srv.getsockname())
        conn, _ = srv.accept()
        with cli, conn:
            assert peer_pid(conn, claimed=os.getpid()) == os.getpid()
            assert peer_pid(conn, claimed=1) is None  # pid 1 does not hold this socket
            assert peer_pid(conn, claimed=None) is None
            other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            try:
                assert peer_pid(conn, claimed=other.pid) is None  # alive, but not the peer
            finally:
                other.kill()
                other.wait()
