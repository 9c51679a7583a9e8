"""``RendezvousClient``: the :class:`KVStore` contract over a ``RendezvousServer`` socket.

One connection per client is one server session. Requests carry ids and replies are
matched by a reader thread, so a thread blocked in ``get``/``watch`` does not hold up
others. The client says its pid in its ``hello`` (the server checks it against ``/proc``
before trusting it, see ``peer.py``).

Liveness (see ``liveness.py`` for how the server judges it): a heartbeat thread sends a
keep-alive frame every ``ttl / 3`` seconds without waiting for any answer, so a slow
server cannot stretch the gap between two beats; the reader thread answers the server's
probes itself, at once. Any request counts as a sign of life too.

When the connection is lost the session is over: every pending and later call raises
``ServiceUnavailable`` and ``session_lost`` turns True; the client does not reconnect (its
ephemeral keys are gone, so its owner must join again). A call whose reply does not come
within its timeout raises ``ServiceUnavailable`` too, but the session is not lost by that
(``session_lost`` stays False): the caller may retry.

Authentication: a server with a token (TCP) sends a challenge in its ``hello`` reply; the
client answers with HMAC-SHA256(``token``, challenge). A client without a token, or with
the wrong one, gets ``ValueError`` naming the server from the constructor.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import itertools
import os
import socket
import threading
from typing import Any

from kvfabric.errors import ServiceUnavailable
from kvfabric.pool.gva.rendezvous.base import (
    KeyValue,
    KVStore,
    WatchEvent,
    check_key,
    check_value,
)
from kvfabric.pool.gva.rendezvous.protocol import (
    BEAT,
    DECODER,
    ERROR_KINDS,
    HEADER,
    MAX_FRAME,
    PROBE_TAG,
    frame,
    parse_address,
)

_REPLY_MARGIN = 10.0  # seconds a reply may take beyond a blocking call's own timeout


class _Pending:
    __slots__ = ("done", "ok", "payload")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.ok = False
        self.payload: Any = None


class RendezvousClient(KVStore):
    """A session with a single-node rendezvous server (see module docstring)."""

    def __init__(
        self, url: str, *, connect_timeout: float = 10.0, call_timeout: float = 30.0, token: str = ""
    ) -> None:
        kind, where = parse_address(url)
        self.url = url
        self.call_timeout = float(call_timeout)
        try:
            if kind == "unix":
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(connect_timeout)
                sock.connect(str(where))
            else:
                host, _, port = str(where).rpartition(":")
                sock = socket.create_connection((host, int(port)), timeout=connect_timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as e:
            raise ServiceUnavailable(f"cannot reach the rendezvous server at {url}: {e}") from e
        sock.settimeout(None)
        self._sock = sock
        self._send_lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)
        self._lost: str | None = None
        self._closed = False
        self._stop = threading.Event()
        self._reader = threading.Thread(target=self._read_loop, name="kvfabric-rdv-reader", daemon=True)
        self._reader.start()
        hello = self._call("hello", os.getpid(), timeout=connect_timeout)
        challenge = hello.get("challenge")
        if challenge is not None:
            if not token:
                self.close()
                raise ValueError(f"the rendezvous server at {url} requires a token (none given)")
            digest = hmac.new(token.encode(), challenge, hashlib.sha256).digest()
            try:
                self._call("auth", digest, timeout=connect_timeout)
            except (ValueError, ServiceUnavailable) as e:
                self.close()
                raise ValueError(f"the rendezvous server at {url} refused the token: {e}") from e
        self.session: int = int(hello["session"])
        self.ttl: float = float(hello["ttl"])
        self._heart = threading.Thread(target=self._heartbeat, name="kvfabric-rdv-heartbeat", daemon=True)
        self._heart.start()

    # ------------------------------------------------------------------ plumbing
    def _read_exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self._sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("connection closed by the rendezvous server")
            buf += chunk
        return bytes(buf)

    def _read_loop(self) -> None:
        reason = "connection closed"
        try:
            while True:
                (n,) = HEADER.unpack(self._read_exact(HEADER.size))
                if n > MAX_FRAME:
                    raise ConnectionError(f"reply frame of {n} B exceeds {MAX_FRAME} B")
                rid, ok, payload = DECODER.decode(self._read_exact(n))
                if rid == 0:
                    if payload == PROBE_TAG:
                        self._answer_probe()
                    continue
                p = self._pending.pop(rid, None)
                if p is not None:
                    p.ok, p.payload = ok, payload
                    p.done.set()
        except (OSError, ConnectionError, ValueError) as e:
            reason = str(e) or type(e).__name__
        self._fail_all(reason)

    def _fail_all(self, reason: str) -> None:
        if self._lost is None:
            self._lost = "client closed" if self._closed else f"rendezvous session lost ({reason})"
        self._stop.set()
        for rid in list(self._pending):
            p = self._pending.pop(rid, None)
            if p is not None:
                p.ok, p.payload = False, ["ServiceUnavailable", self._lost]
                p.done.set()

    def _call(self, op: str, *args: Any, timeout: float | None = None) -> Any:
        self._check_session()
        rid = next(self._ids)
        p = _Pending()
        self._pending[rid] = p
        try:
            with self._send_lock:
                self._sock.sendall(frame([rid, op, *args]))
        except OSError as e:
            self._pending.pop(rid, None)
            self._fail_all(str(e))
            raise ServiceUnavailable(f"{self.url}: {op} failed: {e}") from e
        wait = self.call_timeout if timeout is None else timeout
        if not p.done.wait(wait):
            self._pending.pop(rid, None)
            raise ServiceUnavailable(f"{self.url}: no reply to {op} within {wait:.1f} s")
        if p.ok:
            return p.payload
        kind, msg = p.payload
        raise ERROR_KINDS.get(kind, ServiceUnavailable)(msg)

    def _answer_probe(self) -> None:
        """Reader thread: answer the server's probe. If another thread is sending right now,
        its frame is the answer (any frame is a sign of life), so never wait for the lock."""
        if self._send_lock.acquire(blocking=False):
            try:
                self._sock.sendall(BEAT)
            finally:
                self._send_lock.release()

    def _heartbeat(self) -> None:
        period = max(self.ttl / 3.0, 0.05)
        while not self._stop.wait(period):
            try:
                with self._send_lock:
                    self._sock.sendall(BEAT)
            except OSError as e:
                self._fail_all(str(e))
                return

    @staticmethod
    def _blocking_timeout(timeout: float | None) -> float | None:
        return None if timeout is None else float(timeout) + _REPLY_MARGIN

    # ------------------------------------------------------------------ contract
    def set(self, key: str, value: bytes, *, ephemeral: bool = False) -> int:
        return int(self._call("set", check_key(key), check_value(value), bool(ephemeral)))

    def get(self, key: str, timeout: float | None = 0.0) -> bytes:
        check_key(key)
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must be >= 0 or None, got {timeout}")
        value, _rev = self._call("get", key, timeout, timeout=self._blocking_timeout(timeout) or 1e9)
        return value

    def try_get(self, key: str) -> KeyValue | None:
        r = self._call("try_get", check_key(key))
        return None if r is None else KeyValue(key, r[0], int(r[1]))

    def add(self, key: str, delta: int = 1) -> int:
        if isinstance(delta, bool) or not isinstance(delta, int):
            raise TypeError(f"add needs an int delta, got {delta!r}")
        return int(self._call("add", check_key(key), delta))

    def append(self, key: str, value: bytes) -> int:
        return int(self._call("append", check_key(key), check_value(value)))

    def cas(self, key: str, expected: bytes | None, value: bytes | None) -> tuple[bool, bytes | None]:
        exp = None if expected is None else check_value(expected)
        new = None if value is None else check_value(value)
        ok, cur = self._call("cas", check_key(key), exp, new)
        return bool(ok), cur

    def delete(self, key: str) -> bool:
        return bool(self._call("delete", check_key(key)))

    def delete_prefix(self, prefix: str) -> int:
        return int(self._call("delete_prefix", check_key(prefix)))

    def range(self, prefix: str) -> tuple[list[KeyValue], int]:
        if not isinstance(prefix, str):
            raise TypeError(f"a rendezvous prefix is a str, got {type(prefix).__name__}")
        kvs, rev = self._call("range", prefix)
        return [KeyValue(k, v, int(r)) for k, v, r in kvs], int(rev)

    def watch(self, prefix: str, after: int, timeout: float | None) -> tuple[list[WatchEvent], int]:
        if not isinstance(prefix, str):
            raise TypeError(f"a rendezvous prefix is a str, got {type(prefix).__name__}")
        evs, rev = self._call(
            "watch", prefix, int(after), timeout, timeout=self._blocking_timeout(timeout) or 1e9
        )
        return [WatchEvent(k, v, int(r)) for k, v, r in evs], int(rev)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._reader.join(5)
        self._fail_all("client closed")

    def __repr__(self) -> str:
        return f"RendezvousClient({self.url}, session={getattr(self, 'session', '?')})"
