"""Client transports to the meta service: over sockets (``SocketTransport``) or in-process.

``call(request) -> Reply`` either returns the service's reply or raises
``ServiceUnavailable`` within ``timeout`` seconds; it never hangs. After a timeout the
connection is dropped (so a late reply can never be taken for the next call's) and the
next call reconnects. TCP connections authenticate with the token (HMAC challenge). A reply whose
``error`` is set is raised as ``ValueError`` (the service refused the request itself).
Thread-safe: calls are serialised on one socket per transport.
"""

from __future__ import annotations

import os
import socket
import threading
from multiprocessing.connection import (
    AuthenticationError,
    Connection,
    answer_challenge,
    deliver_challenge,
)
from typing import Any, Protocol

from kvfabric.errors import ServiceUnavailable
from kvfabric.pool import protocol as p
from kvfabric.pool.dispatch import Dispatcher


class Transport(Protocol):
    def call(self, req: Any) -> p.Reply: ...

    def close(self) -> None: ...


def _checked(reply: p.Reply) -> p.Reply:
    if reply.error:
        raise ValueError(f"pool service refused the request: {reply.error}")
    return reply


class LocalTransport:
    """The embedded pool: calls go straight to the dispatcher."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher

    def call(self, req: Any) -> p.Reply:
        return _checked(self.dispatcher.handle(req))

    def close(self) -> None:
        pass


class SocketTransport:
    """RPC over a Unix socket path or ``tcp://host:port`` (see module docstring)."""

    def __init__(self, endpoint: str, timeout: float = 1.0, token: str = "") -> None:
        if endpoint.startswith("tcp://"):
            host, _, port = endpoint[6:].rpartition(":")
            self.address: str | tuple[str, int] = (host, int(port))
            self.family = "AF_INET"
        else:
            self.address = endpoint[6:] if endpoint.startswith("ipc://") else endpoint
            self.family = "AF_UNIX"
        self.endpoint = endpoint
        self.timeout = timeout
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
        with self._lock:
            conn = self._connect()
            try:
                conn.send_bytes(payload)
                if not conn.poll(self.timeout):
                    self._reset()
                    raise ServiceUnavailable(
                        f"pool service at {self.endpoint} did not answer within {self.timeout} s"
                    )
                data = conn.recv_bytes()
            except (OSError, EOFError) as e:
                self._reset()
                raise ServiceUnavailable(f"pool service at {self.endpoint} went away: {e}") from e
        return _checked(p.decode_reply(data))

    def _reset(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def close(self) -> None:
        with self._lock:
            self._reset()
