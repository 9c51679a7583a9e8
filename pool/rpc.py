"""Client transports to the meta service: over pyzmq (``ZmqTransport``) or in-process.

``call(request) -> Reply`` either returns the service's reply or raises
``ServiceUnavailable`` within ``timeout`` seconds; it never hangs. A reply that arrives
after its call timed out is recognised by its request id and dropped. A reply whose
``error`` is set is raised as ``ValueError`` (the service refused the request itself).
Thread-safe: calls are serialised on one socket per transport.
"""

from __future__ import annotations

import itertools
import os
import threading
from typing import Any, Protocol

import zmq

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


class ZmqTransport:
    """RPC over a Unix socket path or ``tcp://host:port`` (see module docstring)."""

    def __init__(self, endpoint: str, timeout: float = 1.0, token: str = "") -> None:
        if not endpoint.startswith(("ipc://", "tcp://")):
            endpoint = f"ipc://{endpoint}"
        self.endpoint = endpoint
        self.timeout = timeout
        self.token = token.encode()
        self._ctx = zmq.Context.instance()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._sock: zmq.Socket | None = None
        self._pid = os.getpid()

    def _socket(self) -> zmq.Socket:
        if self._sock is None or self._pid != os.getpid():
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(self.endpoint)
            self._sock, self._pid = s, os.getpid()
        return self._sock

    def call(self, req: Any) -> p.Reply:
        rid = next(self._ids).to_bytes(8, "little")
        with self._lock:
            if self.endpoint.startswith("ipc://") and not os.path.exists(self.endpoint[6:]):
                raise ServiceUnavailable(f"pool service is not running (no socket {self.endpoint[6:]})")
            sock = self._socket()
            sock.send_multipart([rid, self.token, p.encode(req)])
            deadline_ms = int(self.timeout * 1000)
            while True:
                if not sock.poll(deadline_ms):
                    self._reset()
                    raise ServiceUnavailable(
                        f"pool service at {self.endpoint} did not answer within {self.timeout} s"
                    )
                frames = sock.recv_multipart()
                if len(frames) == 2 and frames[0] == rid:
                    return _checked(p.decode_reply(frames[1]))
                # a late reply to an earlier, timed-out call: drop it and keep waiting

    def _reset(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._reset()
