"""``RpcServer``: the meta service over local sockets (``multiprocessing.connection``).

Transport: the standard library's message connections (length-prefixed frames) carrying
msgspec msgpack; a Unix socket (created mode 0600) always, and TCP when configured, where
a configured token becomes the connection's authentication key (HMAC challenge on
connect, so the secret never crosses the wire). Measured on the 2-core development machine,
a round trip costs 25-45 µs this way with both ends spinning briefly (below; ~100 µs with the
other core idle and nobody spinning, ~20 µs with it busy) against ~160-200 µs through
pyzmq's I/O threads, and metadata RPCs are what a pool's small operations pay for.

Threads: one accept loop per listener, one thread per client connection (blocking reads;
on the Unix socket a connection thread first polls for the next request for ``spin_us``,
yielding its core between polls, which saves the wake-up of a client that calls again at once;
only one connection spins at a time and only while no other request is being served, since
spinning threads of a busy daemon take the interpreter from the one doing the work; and the
ticker turns spinning off for a second whenever the daemon keeps being preempted, the sign
that its cores are shared with other busy work, where a spin only spends the daemon's share
of the CPU: see ``SpinGovernor``),
and one ticker (lease and TTL expiry, metrics, dead-rank detection every 100 ms). Every
request goes through the dispatcher's lock, so the service stays single-threaded.
``stop()`` closes the listeners and connections and removes the socket file (only the one
``start()`` bound: the daemon's socket lock makes it the only server on that path).

Security: TCP needs a ``token`` unless ``insecure`` says otherwise (the constructor
refuses, naming the setting). The token's HMAC challenge runs in the connection's own
thread with a time limit (``AUTH_TIMEOUT_S``), so a peer that connects and says nothing
holds up no one; a wrong token closes only that connection (logged).
"""

from __future__ import annotations

import logging
import os
import resource
import socket
import struct
import threading
from multiprocessing.connection import (
    AuthenticationError,
    Connection,
    Listener,
    answer_challenge,
    deliver_challenge,
)

from kvfabric.pool import protocol as p
from kvfabric.pool.client.rpc import spin_poll
from kvfabric.pool.gva.rendezvous.peer import peer_pid
from kvfabric.pool.service.dispatch import Dispatcher

log = logging.getLogger("kvfabric.pool.server")
TICK_S = 0.1
AUTH_TIMEOUT_S = 5.0  # a TCP peer that has not answered the token challenge by then is dropped


class SpinGovernor:
    """Whether the daemon's connection threads may spin, decided once per tick.

    Spinning pays where a core is free for it. Where the daemon shares its cores with other
    busy work it keeps being preempted (measured on the 2-core development machine over
    100 ms ticks: 0 to about 100 involuntary context switches with the other core idle,
    550 to 700 with it busy or with four clients, 10 or fewer without spinning), and the
    spin only spends the daemon's share of the CPU. So: above ``limit`` preemptions in a
    tick while spinning is on, it goes off for ``backoff`` ticks, then is tried again.
    Call ``tick()`` from one thread; ``allowed`` may be read from any."""

    def __init__(self, limit: int = 250, backoff: int = 10) -> None:
        self.limit, self.backoff = limit, backoff
        self.allowed = True
        self._off_ticks = 0
        self._last = _preemptions()

    def tick(self) -> None:
        now = _preemptions()
        delta, self._last = now - self._last, now
        if self.allowed and delta > self.limit:
            self.allowed, self._off_ticks = False, self.backoff
        elif not self.allowed:
            self._off_ticks -= 1
            if self._off_ticks <= 0:
                self.allowed = True


def _preemptions() -> int:
    """Involuntary context switches of this process so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw


class RpcServer:
    """See module docstring."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        socket_path: str,
        tcp: tuple[str, int] | None = None,
        token: str = "",
        spin_us: float = 0.0,
        insecure: bool = False,
    ) -> None:
        if tcp is not None and not token and not insecure:
            raise ValueError(
                f"a TCP RPC listener on {tcp[0]}:{tcp[1]} needs a token (pool config token) or "
                "insecure: true to serve without authentication"
            )
        self.dispatcher = dispatcher
        self.socket_path = socket_path
        self.tcp = tcp
        self.token = token.encode() or None
        self.spin_s = spin_us * 1e-6
        self._spin_token = threading.Lock()
        self.governor = SpinGovernor()
        self._serving = 0  # connection threads handling a request now
        self.tcp_port: int | None = None
        self._listeners: list[Listener] = []
        self._conns: dict[Connection, int] = {}  # open connection -> its peer process (0: unknown)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._bound: os.stat_result | None = None  # the socket file as bound by start()

    def start(self) -> None:
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)  # stale: the daemon holds this socket's lock
        old = os.umask(0o177)
        try:
            unix = Listener(self.socket_path, family="AF_UNIX", backlog=128)
        finally:
            os.umask(old)
        self._bound = os.stat(self.socket_path)
        os.chmod(self.socket_path, 0o600)
        self._listeners.append(unix)
        if self.tcp is not None:
            tcp = Listener(self.tcp, family="AF_INET", backlog=128)  # token checked per connection
            self.tcp_port = tcp.address[1]
            self._listeners.append(tcp)
        for lst in self._listeners:
            self._spawn(self._accept_loop, lst, name="kvfabric-pool-accept")
        self._spawn(self._tick_loop, name="kvfabric-pool-tick")

    def peer_pids(self) -> list[int]:
        """The peer process of each open connection (0 where unknown: TCP, or not read yet);
        the daemon's idle exit counts them."""
        with self._lock:
            return sorted(self._conns.values())

    def _spawn(self, target: object, *args: object, name: str) -> None:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)  # type: ignore[arg-type]
        t.start()
        self._threads.append(t)

    def _accept_loop(self, listener: Listener) -> None:
        while not self._stop.is_set():
            try:
                conn = listener.accept()
            except (OSError, EOFError) as e:
                if self._stop.is_set():
                    return
                log.warning("refused a pool connection: %s", e)  # e.g. wrong token
                continue
            except Exception as e:  # noqa: BLE001 - AuthenticationError and friends
                log.warning("refused a pool connection: %s", e)
                continue
            with self._lock:
                self._conns[conn] = 0  # its peer is read by the connection's thread
            unix = listener is self._listeners[0]
            spin_s = self.spin_s if unix else 0.0
            self._spawn(self._serve, conn, spin_s, not unix, name="kvfabric-pool-conn")

    def _serve(self, conn: Connection, spin_s: float, tcp: bool = False) -> None:
        pid = _peer_pid(conn)
        with self._lock:
            self._conns[conn] = pid
        try:
            if tcp and self.token is not None and not _challenge(conn, self.token):
                return
            while not self._stop.is_set():
                try:
                    if spin_s and self.governor.allowed and self._spin_token.acquire(blocking=False):
                        try:  # one connection spins at a time, and only while no other is served
                            if self._serving == 0:
                                spin_poll(conn, spin_s)
                        finally:
                            self._spin_token.release()
                    data = conn.recv_bytes(p.MAX_FRAME)  # a longer frame: OSError, closed
                except (EOFError, OSError):
                    return
                with self._lock:
                    self._serving += 1
                try:
                    reply = self.dispatcher.handle(p.decode_request(data), pid)
                except Exception as e:  # noqa: BLE001 - a malformed request must not stop the service
                    log.warning("refused a malformed request: %s", e)
                    reply = p.Reply(self.dispatcher.epoch, error=f"malformed request: {e}")
                finally:
                    with self._lock:
                        self._serving -= 1
                try:
                    conn.send_bytes(p.encode(reply))
                except OSError:
                    return
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    def _tick_loop(self) -> None:
        while not self._stop.wait(TICK_S):
            if self.spin_s:
                self.governor.tick()
            try:
                self.dispatcher.tick()
            except Exception:
                log.exception("pool housekeeping failed")

    def stop(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        for lst in self._listeners:
            _wake(lst.address)
            lst.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:  # unblock the connection threads' reads
            try:
                s = socket.socket(fileno=os.dup(c.fileno()))
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass
        for t in self._threads:
            t.join(2)
        try:  # only the socket file this server bound, never one that replaced it
            if self._bound is not None and os.path.samestat(self._bound, os.stat(self.socket_path)):
                os.unlink(self.socket_path)
        except FileNotFoundError:
            pass


def _challenge(conn: Connection, token: bytes) -> bool:
    """The token's HMAC challenge both ways, within ``AUTH_TIMEOUT_S``; False (logged) when
    the peer failed it or said nothing."""
    try:
        with socket.socket(fileno=os.dup(conn.fileno())) as s:
            tv = struct.pack("ll", int(AUTH_TIMEOUT_S), 0)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)  # the fd stays blocking
            deliver_challenge(conn, token)
            answer_challenge(conn, token)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 0))
        return True
    except (AuthenticationError, OSError, EOFError) as e:
        log.warning("refused a pool connection: %s", e or type(e).__name__)  # e.g. wrong token
        return False


def _peer_pid(conn: Connection) -> int:
    """The peer's process on a Unix socket (SO_PEERCRED); 0 over TCP or when unknown."""
    try:
        with socket.socket(fileno=os.dup(conn.fileno())) as sock:
            return peer_pid(sock, None) or 0
    except OSError:
        return 0


def _wake(address: object) -> None:
    """Connect once to a listener so its blocking accept() returns."""
    family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.settimeout(0.2)
            s.connect(address)  # type: ignore[arg-type]
    except OSError:
        pass
