"""``RendezvousServer``: the single-node rendezvous store, served over a local socket.

Embeddable: the pool daemon (or a test) builds one, calls ``start()`` and hands
``server.url`` to its ranks; the server runs an asyncio loop on its own thread until
``close()``. ``python -m kvfabric.pool.gva.rendezvous.server --port N`` runs one in the
foreground. It binds 127.0.0.1 (or a Unix socket) only. Data lives in memory only: a
restarted server starts empty.

Sessions: each connection is one session; its ephemeral keys are deleted when it ends.
A session ends at once when its connection closes (the client closed it, or its process
died: the kernel closes the sockets of a dead process), or when it stays silent and its
process cannot show it is alive: ``liveness.py`` holds that judgement (probe after
``session_ttl``, look at the peer process after ``probe_grace``, give up after
``max_silence``, and never count the server's own stalls as a peer's silence); this
module runs it on every tick and sends the probes and closes the sessions it ends.

Listeners and authentication: TCP (``host``/``port``), a Unix socket (``unix_path``,
created mode 0600), or both at once over one store (the pool daemon of a node that serves
other nodes: its own node's clients come through the Unix socket, other nodes' through
TCP). With a ``token`` a TCP session must prove it knows it before anything but
``hello``, ``auth`` and keep-alives is served: the ``hello`` reply carries a random
challenge, the client answers ``auth`` with HMAC-SHA256(token, challenge) (the secret never
crosses the wire), and a wrong answer ends the session. Unix-socket sessions are trusted
by the socket file's mode, as the pool's RPC socket is.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import hashlib
import hmac
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from kvfabric.errors import KeyNotFound
from kvfabric.pool.gva.rendezvous.base import WatchEvent, check_key, check_value
from kvfabric.pool.gva.rendezvous.liveness import Liveness, SilenceRules, Verdict
from kvfabric.pool.gva.rendezvous.liveness import Session as _Session
from kvfabric.pool.gva.rendezvous.protocol import (
    BEAT_OP,
    DECODER,
    HEADER,
    MAX_FRAME,
    PROBE,
    error_kind,
    frame,
)
from kvfabric.pool.gva.rendezvous.state import StoreState

log = logging.getLogger("kvfabric.gva.rendezvous")


DEFAULT_SESSION_TTL = 10.0  # seconds of silence before a session is probed (sized for a loaded 2-core box)


class RendezvousServer:
    """The single-node rendezvous store (see module docstring)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        unix_path: str | None = None,
        session_ttl: float = DEFAULT_SESSION_TTL,
        probe_grace: float | None = None,
        max_silence: float | None = None,
        history: int = 65536,
        token: str = "",
        tcp: bool | None = None,
        insecure: bool = False,
    ) -> None:
        """``tcp``: listen on ``host``:``port`` too (default: only when no ``unix_path``).
        TCP on an address other than loopback needs a ``token`` unless ``insecure``."""
        self.host, self.port, self.unix_path = host, int(port), unix_path
        self.tcp = unix_path is None if tcp is None else bool(tcp)
        if not self.tcp and unix_path is None:
            raise ValueError("RendezvousServer: tcp=False needs a unix_path")
        if self.tcp and not token and not insecure and not _loopback(host):
            raise ValueError(
                f"a rendezvous server on {host}:{port} (reachable from other hosts) needs a token, "
                "or insecure=True to serve without authentication"
            )
        self._token = token.encode()
        self._challenges: dict[int, bytes] = {}  # TCP session -> challenge, until it authenticates
        self.rules = SilenceRules(session_ttl, probe_grace, max_silence)
        self.session_ttl = self.rules.session_ttl
        self.probe_grace = self.rules.probe_grace
        self.max_silence = self.rules.max_silence
        self.state = StoreState(history)
        self.state.listeners.append(self._on_change)
        self._waiters: list[tuple[str, bool, asyncio.Future[None]]] = []
        self._sessions: dict[int, _Session] = {}
        self._next_sid = 1
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._servers: list[asyncio.AbstractServer] = []
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._closed = False

    @property
    def url(self) -> str:
        """The Unix socket's url when there is one, else the TCP one."""
        if self.unix_path:
            return f"kvf+unix://{self.unix_path}"
        return self.tcp_url

    @property
    def tcp_url(self) -> str:
        if not self.tcp:
            raise ValueError("this rendezvous server does not listen on TCP")
        return f"kvf://{self.host}:{self.port}"

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 10.0) -> RendezvousServer:
        """Start serving on a background thread; returns once the socket is bound."""
        if self._thread is not None:
            raise ValueError("RendezvousServer.start called twice")
        self._thread = threading.Thread(target=self._run, name="kvfabric-rendezvous", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"rendezvous server did not start within {timeout} s")
        if self._error is not None:
            raise self._error
        return self

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._open())
        except BaseException as e:  # noqa: BLE001 - reported to start()
            self._error = e
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(self._shutdown())
            loop.close()

    async def _open(self) -> None:
        if self.unix_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.unix_path)
            old = os.umask(0o177)
            try:
                unix = await asyncio.start_unix_server(
                    functools.partial(self._serve, remote=False), path=self.unix_path
                )
            finally:
                os.umask(old)
            self._servers.append(unix)
        if self.tcp:
            serve = functools.partial(self._serve, remote=True)
            srv = await asyncio.start_server(serve, self.host, self.port)
            self.port = srv.sockets[0].getsockname()[1]
            self._servers.append(srv)
        self._server = self._servers[0]
        asyncio.get_running_loop().create_task(self._expire_sessions())

    async def _shutdown(self) -> None:
        for srv in self._servers:
            srv.close()
        for s in list(self._sessions.values()):
            s.writer.close()
        for _, _, fut in self._waiters:
            if not fut.done():
                fut.cancel()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.unix_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.unix_path)

    def close(self) -> None:
        """Stop serving and drop every session. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def serve_forever(self) -> None:
        self.start()
        assert self._thread is not None
        try:
            while self._thread.is_alive():
                self._thread.join(1.0)
        except KeyboardInterrupt:
            pass
        finally:
            self.close()

    def __enter__(self) -> RendezvousServer:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ sessions
    async def _expire_sessions(self) -> None:
        tick = self.rules.tick
        prev = time.monotonic()
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            late, prev = self.rules.late(now - prev), now
            if late:  # the loop did not run: frames may be waiting unread; nobody was silent
                for s in list(self._sessions.values()):
                    s.credit(late, now)
                continue
            for s in list(self._sessions.values()):
                verdict = self.rules.judge(s, now)
                if verdict is Verdict.PROBE:  # its client's reader thread answers with a beat
                    if not s.writer.is_closing():
                        s.writer.write(PROBE)
                elif verdict is Verdict.DROP:
                    s.writer.close()
                    self._end_session(s)

    def _end_session(self, s: _Session) -> None:
        if self._sessions.pop(s.id, None) is None:
            return
        for t in s.tasks:
            t.cancel()
        self._challenges.pop(s.id, None)
        n = self.state.drop_session(s.id)
        if n:
            log.info("rendezvous session %d ended: %d ephemeral key(s) deleted", s.id, n)

    async def _serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, remote: bool = True
    ) -> None:
        s = _Session(self._next_sid, writer)
        self._next_sid += 1
        self._sessions[s.id] = s
        if remote and self._token:
            self._challenges[s.id] = os.urandom(32)
        try:
            while True:
                head = await reader.readexactly(HEADER.size)
                (n,) = HEADER.unpack(head)
                if n > MAX_FRAME:
                    raise ValueError(f"frame of {n} B exceeds {MAX_FRAME} B")
                msg = DECODER.decode(await reader.readexactly(n))
                if s.heard(time.monotonic()) is Liveness.KEPT:
                    log.info("rendezvous session %d speaks again", s.id)
                self._dispatch(s, msg)
        except (asyncio.IncompleteReadError, ConnectionError, ValueError, asyncio.CancelledError):
            pass
        except Exception:
            log.exception("rendezvous session %d failed", s.id)
        finally:
            self._end_session(s)
            writer.close()

    # ------------------------------------------------------------------ requests
    def _reply(self, s: _Session, rid: int, ok: bool, payload: Any) -> None:
        if s.id in self._sessions:
            s.writer.write(frame([rid, ok, payload]))

    def _dispatch(self, s: _Session, msg: list[Any]) -> None:
        rid, op, args = msg[0], msg[1], msg[2:]
        if op == BEAT_OP:  # a keep-alive: the frame itself was the point, nothing to answer
            return
        if s.id in self._challenges and op not in ("hello", "auth"):
            self._reply(s, rid, False, ["ValueError", "rendezvous: authenticate first (auth with the token)"])
            s.writer.close()
            self._end_session(s)
            return
        if op == "auth":
            self._auth(s, rid, args)
            return
        blocking = self._BLOCKING.get(op)
        if blocking is not None:
            task = asyncio.get_running_loop().create_task(
                self._run_blocking(s, rid, blocking(self, s, *args))
            )
            s.tasks.add(task)
            task.add_done_callback(s.tasks.discard)
            return
        try:
            result = self._call(s, op, args)
        except (KeyNotFound, ValueError, TypeError) as e:
            self._reply(s, rid, False, [error_kind(e), str(e)])
        else:
            self._reply(s, rid, True, result)

    async def _run_blocking(self, s: _Session, rid: int, coro: Awaitable[Any]) -> None:
        try:
            result = await coro
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - every failure goes back to the client
            self._reply(s, rid, False, [error_kind(e), str(e)])
        else:
            self._reply(s, rid, True, result)

    def _auth(self, s: _Session, rid: int, a: list[Any]) -> None:
        """``auth(digest)``: HMAC-SHA256(token, challenge) ends the challenge; anything else
        ends the session."""
        challenge = self._challenges.get(s.id)
        if challenge is None:
            self._reply(s, rid, True, None)  # nothing asked (a Unix socket, or no token)
            return
        want = hmac.new(self._token, challenge, hashlib.sha256).digest()
        if a and isinstance(a[0], bytes) and hmac.compare_digest(a[0], want):
            del self._challenges[s.id]
            self._reply(s, rid, True, None)
            return
        log.warning("rendezvous session %d refused: wrong token", s.id)
        self._reply(s, rid, False, ["ValueError", "rendezvous: wrong token"])
        s.writer.close()
        self._end_session(s)

    def _call(self, s: _Session, op: str, a: list[Any]) -> Any:
        st = self.state
        if op == "ping":
            return None
        if op == "hello":
            if a and isinstance(a[0], int) and not isinstance(a[0], bool):
                s.claimed_pid = a[0]  # believed only once checked against /proc (peer.py)
            out = {"session": s.id, "ttl": self.session_ttl, "probe_grace": self.probe_grace}
            if s.id in self._challenges:
                out["challenge"] = self._challenges[s.id]
            return out
        if op == "set":
            return st.set(check_key(a[0]), check_value(a[1]), s.id if a[2] else None)
        if op == "try_get":
            kv = st.get(check_key(a[0]))
            return None if kv is None else [kv.value, kv.revision]
        if op == "add":
            if isinstance(a[1], bool) or not isinstance(a[1], int):
                raise TypeError(f"add needs an int delta, got {a[1]!r}")
            return st.add(check_key(a[0]), a[1])
        if op == "append":
            return st.append(check_key(a[0]), check_value(a[1]))
        if op == "cas":
            exp = None if a[1] is None else check_value(a[1])
            new = None if a[2] is None else check_value(a[2])
            return list(st.cas(check_key(a[0]), exp, new))
        if op == "delete":
            return st.delete(check_key(a[0]))
        if op == "delete_prefix":
            return st.delete_prefix(check_key(a[0]))
        if op == "range":
            kvs, rev = st.range(a[0] if isinstance(a[0], str) else check_key(a[0]))
            return [[[kv.key, kv.value, kv.revision] for kv in kvs], rev]
        raise ValueError(f"unknown rendezvous operation {op!r}")

    # ------------------------------------------------------------------ blocking ops
    def _on_change(self, ev: WatchEvent) -> None:
        keep = []
        for w in self._waiters:
            key, exact, fut = w
            if (ev.key == key) if exact else ev.key.startswith(key):
                if not fut.done():
                    fut.set_result(None)
            else:
                keep.append(w)
        self._waiters = keep

    async def _wait_change(self, key: str, exact: bool, timeout: float | None) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        w = (key, exact, fut)
        self._waiters.append(w)
        try:
            await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            with contextlib.suppress(ValueError):
                self._waiters.remove(w)

    async def _get(self, s: _Session, key: str, timeout: float | None) -> Any:
        check_key(key)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            kv = self.state.get(key)
            if kv is not None:
                return [kv.value, kv.revision]
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise KeyNotFound(f"rendezvous key {key!r} did not appear within {timeout} s")
            await self._wait_change(key, True, left)

    async def _watch(self, s: _Session, prefix: str, after: int, timeout: float | None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            evs = self.state.events_after(prefix, int(after))
            if evs:
                return [[[e.key, e.value, e.revision] for e in evs], self.state.rev]
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return [[], self.state.rev]
            await self._wait_change(prefix, False, left)

    _BLOCKING: dict[str, Callable[..., Awaitable[Any]]] = {"get": _get, "watch": _watch}


def _loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="kvfabric single-node rendezvous store")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--unix", default=None, help="serve on this Unix socket path instead of TCP")
    p.add_argument(
        "--ttl", type=float, default=DEFAULT_SESSION_TTL, help="seconds of silence before a session is probed"
    )
    p.add_argument("--grace", type=float, default=None, help="seconds a probe may go unanswered")
    p.add_argument("--max-silence", type=float, default=None, help="longest silence of a live process")
    p.add_argument("--token", default="", help="shared secret TCP sessions must prove they know")
    p.add_argument("--insecure", action="store_true", help="allow TCP beyond loopback without a token")
    args = p.parse_args(argv)
    srv = RendezvousServer(
        args.host,
        args.port,
        unix_path=args.unix,
        session_ttl=args.ttl,
        probe_grace=args.grace,
        max_silence=args.max_silence,
        token=args.token,
        insecure=args.insecure,
    )
    srv.start()
    print(srv.url, flush=True)
    srv.serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
