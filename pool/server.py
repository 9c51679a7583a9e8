"""``RpcServer``: the meta service on pyzmq, over a Unix socket and optionally TCP.

One thread owns the sockets and the service loop: it receives ``[rid, token, payload]``
frames on ROUTER sockets, answers ``[rid, reply]``, and ticks the service (lease and TTL
expiry, metrics) every 100 ms. The Unix socket is created mode 0600; TCP binds the
configured host (127.0.0.1 unless told otherwise) and, when a token is configured,
refuses requests that do not carry it. ``stop()`` closes the sockets and removes the
socket file.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import zmq

from kvfabric.pool import protocol as p
from kvfabric.pool.dispatch import Dispatcher

log = logging.getLogger("kvfabric.pool.server")
TICK_S = 0.1


def ipc_endpoint(path: str) -> str:
    return f"ipc://{path}"


class RpcServer:
    """See module docstring."""

    def __init__(
        self, dispatcher: Dispatcher, socket_path: str, tcp: tuple[str, int] | None = None, token: str = ""
    ) -> None:
        self.dispatcher = dispatcher
        self.socket_path = socket_path
        self.tcp = tcp
        self.token = token.encode()
        self.tcp_port: int | None = None
        self._ctx = zmq.Context.instance()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvfabric-pool-rpc", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise self._error

    def _bind(self) -> list[tuple[zmq.Socket, bool]]:
        socks = []
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)  # a stale socket of a dead daemon (the daemon checked)
        ipc = self._ctx.socket(zmq.ROUTER)
        ipc.setsockopt(zmq.LINGER, 0)
        old = os.umask(0o177)
        try:
            ipc.bind(ipc_endpoint(self.socket_path))
        finally:
            os.umask(old)
        os.chmod(self.socket_path, 0o600)
        socks.append((ipc, False))
        if self.tcp is not None:
            tcp = self._ctx.socket(zmq.ROUTER)
            tcp.setsockopt(zmq.LINGER, 0)
            host, port = self.tcp
            if port == 0:
                self.tcp_port = tcp.bind_to_random_port(f"tcp://{host}")
            else:
                tcp.bind(f"tcp://{host}:{port}")
                self.tcp_port = port
            socks.append((tcp, True))
        return socks

    def _run(self) -> None:
        try:
            socks = self._bind()
        except BaseException as e:  # noqa: BLE001 - reported to start()
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        for s, _ in socks:
            poller.register(s, zmq.POLLIN)
        next_tick = time.monotonic() + TICK_S
        try:
            while not self._stop.is_set():
                timeout_ms = max(0, int((next_tick - time.monotonic()) * 1000))
                events = dict(poller.poll(timeout_ms))
                for sock, is_tcp in socks:
                    if sock in events:
                        self._serve_one(sock, is_tcp)
                if time.monotonic() >= next_tick:
                    self.dispatcher.tick()
                    next_tick = time.monotonic() + TICK_S
        finally:
            for s, _ in socks:
                s.close(0)
            try:
                os.unlink(self.socket_path)
            except FileNotFoundError:
                pass

    def _serve_one(self, sock: zmq.Socket, is_tcp: bool) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 4:
                continue
            ident, rid, token, payload = frames
            if is_tcp and self.token and token != self.token:
                reply = p.Reply(self.dispatcher.epoch, error="bad or missing token")
            else:
                try:
                    reply = self.dispatcher.handle(p.decode_request(payload))
                except Exception as e:  # noqa: BLE001 - a malformed request must not stop the service
                    log.warning("refused a malformed request: %s", e)
                    reply = p.Reply(self.dispatcher.epoch, error=f"malformed request: {e}")
            sock.send_multipart([ident, rid, p.encode(reply)])

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
