"""Client transport to the meta service over sockets (``SocketTransport``); the in-process
one of an embedded pool is ``kvfabric.pool.service.local.LocalTransport``.

``call(request) -> Reply`` either returns the service's reply or raises
``ServiceUnavailable`` within ``timeout`` seconds; it never hangs. After a timeout the
connection is dropped (so a late reply can never be taken for the next call's) and the
next call reconnects. TCP connections authenticate with the token (HMAC challenge). A reply whose
``error`` is set is raised as ``ValueError`` (the service refused the request itself, naming
the bad field; see ``dispatch.py``), and so is a request longer than ``MAX_FRAME``.
Thread-safe: calls are serialised on one socket per transport.

Waiting for a reply: on a Unix socket the caller first polls for up to ``spin_us``
(yielding the core between polls, and giving up at once when a yield shows another task
wanted the core) and only then sleeps in ``poll``. A reply from a daemon on
the same node comes back in tens of µs, and a sleeping caller adds its own wake-up to
each round trip (about 100 µs per metadata RPC with the other core idle against about 45 µs
with the short spin, measured on the 2-core development machine). TCP connections, which
may cross nodes, sleep at once (``spin_us`` 0).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from multiprocessing.connection import (
    AuthenticationError,
    Connection,
    answer_challenge,
    deliver_challenge,
)
from typing import Any, Protocol

from kvfabric.errors import ServiceUnavailable
from kvfabric.pool import protocol as p

SPIN_US = 100.0  # see module docstring


CONTENDED_YIELD_S = 20e-6  # a yield that took longer gave the core to another task


def spin_poll(conn: Connection, seconds: float) -> bool:
    """Poll ``conn`` without sleeping for up to ``seconds``; True once data is there.

    Gives up early when a yield took long: another task wanted this core (a busy machine,
    or the peer itself sharing it), and spinning would only compete with it."""
    now = time.perf_counter()
    end = now + seconds
    while not conn.poll(0):
        if now >= end:
            return False
        os.sched_yield()
        after = time.perf_counter()
        if after - now > CONTENDED_YIELD_S:
            return conn.poll(0)
        now = after
    return True


class Transport(Protocol):
    def call(self, req: Any) -> p.Reply: ...

    def close(self) -> None: ...


def checked(reply: p.Reply) -> p.Reply:
    if reply.error:
        raise ValueError(f"pool service refused the request: {reply.error}")
    return reply


class SocketTransport:
    """RPC over a Unix socket path or ``tcp://host:port`` (see module docstring)."""

    def __init__(
        self, endpoint: str, timeout: float = 1.0, token: str = "", spin_us: float | None = None
    ) -> None:
        if endpoint.startswith("tcp://"):
            host, _, port = endpoint[6:].rpartition(":")
            self.address: str | tuple[str, int] = (host, int(port))
            self.family = "AF_INET"
        else:
            self.address = endpoint[6:] if endpoint.startswith("ipc://") else endpoint
            self.family = "AF_UNIX"
        self.endpoint = endpoint
        self.timeout = timeout
        if spin_us is None:
            spin_us = SPIN_US if self.family == "AF_UNIX" else 0.0
        if not 0 <= spin_us <= 10_000:
            raise ValueError(f"spin_us must be between 0 and 10000, got {spin_us!r}")
        self.spin_s = spin_us * 1e-6
        self.token = token.encode() or None
        self._lock = threading.Lock()
        self._conn: Connection | None = None
        self._pid = os.getpid()

    def _connect(self) -> Connection:
        if self._conn is None or self._pid != os.getpid():
            try:
                if self.family == "AF_UNIX":
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                else:
                    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.settimeout(self.timeout)
                sock.connect(self.address)
                sock.settimeout(None)
                conn = Connection(sock.detach())
                if self.token is not None:
                    answer_challenge(conn, self.token)
                    deliver_challenge(conn, self.token)
            except (OSError, EOFError, AuthenticationError) as e:
                raise ServiceUnavailable(f"pool service at {self.endpoint} is not reachable: {e}") from e
            self._conn, self._pid = conn, os.getpid()
        return self._conn

    def call(self, req: Any) -> p.Reply:
        payload = p.encode(req)
        if len(payload) > p.MAX_FRAME:  # the service would close the connection unread
            raise ValueError(f"pool request of {len(payload)} B is longer than {p.MAX_FRAME} B: split it")
        with self._lock:
            conn = self._connect()
            try:
                conn.send_bytes(payload)
                if not (self.spin_s and spin_poll(conn, self.spin_s)) and not conn.poll(self.timeout):
                    self._reset()
                    raise ServiceUnavailable(
                        f"pool service at {self.endpoint} did not answer within {self.timeout} s"
                    )
                data = conn.recv_bytes()
            except (OSError, EOFError) as e:
                self._reset()
                raise ServiceUnavailable(f"pool service at {self.endpoint} went away: {e}") from e
        return checked(p.decode_reply(data))

    def _reset(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def close(self) -> None:
        with self._lock:
            self._reset()
