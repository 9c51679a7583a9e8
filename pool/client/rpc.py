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

``call_unchecked(request, timeout=None)`` is ``call`` without raising a refusal (the caller
reads ``Reply.error`` itself: the leader-following transport, ``leader.py``, retries a
``NOT_LEADER`` answer elsewhere); ``timeout`` bounds that one call instead of ``timeout``.
``remote`` is True over TCP (the session then joins the pool's rendezvous over TCP too).
"""

from __future__ import annotations

import os
import socket
import struct
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


class SentUnanswered(ServiceUnavailable):
    """The request was sent but no reply came: the service may have acted on it."""


class TokenRefused(ServiceUnavailable):
    """The service refused this client's token (a wrong shared secret)."""


def _authenticate(conn: Connection, token: bytes, timeout: float) -> None:
    """The HMAC challenge both ways (``multiprocessing.connection``), bounded by ``timeout``:
    the handshake's reads block, so a stalled service must not hold the caller past it."""
    with socket.socket(fileno=os.dup(conn.fileno())) as s:
        # kernel timeouts (the fd stays blocking, as Connection needs): reads past it fail
        tv = struct.pack("ll", int(timeout), int((timeout % 1) * 1e6) or (0 if timeout >= 1 else 1000))
        for opt in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
            s.setsockopt(socket.SOL_SOCKET, opt, tv)
        answer_challenge(conn, token)
        deliver_challenge(conn, token)
        for opt in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
            s.setsockopt(socket.SOL_SOCKET, opt, struct.pack("ll", 0, 0))


class Transport(Protocol):
    """What a session calls the meta service through: ``call`` returns the reply or raises
    (``ServiceUnavailable`` within its timeout, ``ValueError`` for a refused request);
    ``close`` releases the connection. Transports may have ``remote`` (bool, default
    False: the service is reached over the network) and ``token`` (its shared secret)."""

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

    def _connect(self, timeout: float | None = None) -> Connection:
        if self._conn is None or self._pid != os.getpid():
            wait = self.timeout if timeout is None else timeout
            try:
                if self.family == "AF_UNIX":
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                else:
                    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.settimeout(wait)
                sock.connect(self.address)
                sock.settimeout(None)
                conn = Connection(sock.detach())
                if self.token is not None:
                    _authenticate(conn, self.token, wait)
            except AuthenticationError as e:
                raise TokenRefused(f"pool service at {self.endpoint} refused the token: {e}") from e
            except (OSError, EOFError) as e:
                raise ServiceUnavailable(f"pool service at {self.endpoint} is not reachable: {e}") from e
            self._conn, self._pid = conn, os.getpid()
        return self._conn

    @property
    def remote(self) -> bool:
        return self.family == "AF_INET"

    def call(self, req: Any) -> p.Reply:
        return checked(self.call_unchecked(req))

    def call_unchecked(self, req: Any, timeout: float | None = None) -> p.Reply:
        """One round trip; the reply as it came (see module docstring). ``SentUnanswered``
        (a ``ServiceUnavailable``) when the request left but no reply came, so the caller
        knows the service may have acted on it; plain ``ServiceUnavailable`` when it never
        left (no connection)."""
        payload = p.encode(req)
        if len(payload) > p.MAX_FRAME:  # the service would close the connection unread
            raise ValueError(f"pool request of {len(payload)} B is longer than {p.MAX_FRAME} B: split it")
        wait = self.timeout if timeout is None else timeout
        with self._lock:
            end = time.monotonic() + wait  # connecting (and the token's challenge) count too
            conn = self._connect(wait)
            try:
                conn.send_bytes(payload)
                left = max(end - time.monotonic(), 0.001)
                if not (self.spin_s and spin_poll(conn, self.spin_s)) and not conn.poll(left):
                    self._reset()
                    raise SentUnanswered(f"pool service at {self.endpoint} did not answer within {wait} s")
                data = conn.recv_bytes()
            except (OSError, EOFError) as e:
                self._reset()
                raise SentUnanswered(f"pool service at {self.endpoint} went away: {e}") from e
            if data.startswith(b"#CHALLENGE#"):  # multiprocessing's token challenge
                self._reset()
                raise TokenRefused(f"pool service at {self.endpoint} asks for a token; none was given")
        return p.decode_reply(data)

    def _reset(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def close(self) -> None:
        with self._lock:
            self._reset()
