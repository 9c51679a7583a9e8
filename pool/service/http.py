"""The pool daemon's HTTP endpoint: ``/health``, ``/metrics``, ``/capacity``, ``/keys``.

``/health`` answers 200 with JSON (ready, role, epoch, ranks, capacity, objects) when the
node's checks pass (``health.py``: table published, fabric joined, rendezvous reachable,
not out of space, leading when it campaigns) and 503 with ``failing`` (check -> reason)
when one does not; ``/health?standby=ok`` also answers 200 for a standby that fails
nothing but the leadership (a liveness probe's question); ``/metrics`` is the
Prometheus text format of ``kvfabric_pool_*``; ``/capacity`` lists each window's
capacity, use and evictions; ``/keys?prefix=P&start=N&limit=M`` pages through readable
keys, each rendered by ``keys.key_text`` (text as it is, other bytes as ``\\xNN``; a
prefix is given in the same form, so ``prefix=kv/\\x8a`` selects binary keys). Served
by a small threaded ``http.server`` on the configured host and port.

``POST /prefix`` (JSON in and out; ``prefix.py``): how many leading blocks of a list of
block ids (or of KV-event block hashes) the pool holds, and where each is (rank, node,
tier); read from the shared table without the service's lock.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

from kvfabric.pool import protocol as p
from kvfabric.pool.keys import key_from_text
from kvfabric.pool.service.dispatch import Dispatcher
from kvfabric.pool.service.health import Health
from kvfabric.pool.service.prefix import PrefixQuery

MAX_BODY = 16 << 20  # bytes of a POST body at most


def _handler(
    dispatcher: Dispatcher, health: Callable[[], Health], prefix: PrefixQuery | None = None
) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt: str, *args: Any) -> None:  # quiet: the daemon logs
            pass

        def _send(self, code: int, body: bytes, ctype: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _json(self, obj: Any, code: int = 200) -> None:
            self._send(code, json.dumps(obj, default=str).encode(), "application/json")

        def do_GET(self) -> None:
            url = urlparse(self.path)
            if url.path == "/health":
                h = health()
                standby_ok = parse_qs(url.query).get("standby", [""])[0] == "ok"
                self._json(h.as_json(), 200 if h.ready or (standby_ok and h.fit_to_take_over) else 503)
            elif url.path == "/metrics":
                with dispatcher.lock:
                    dispatcher.metrics.update_state(dispatcher.service)
                self._send(200, dispatcher.metrics.render(), "text/plain; version=0.0.4")
            elif url.path == "/capacity":
                self._json(dispatcher.handle(p.Info()).data["capacity"])
            elif url.path == "/keys":
                q = parse_qs(url.query)
                try:
                    start = int(q.get("start", ["0"])[0])
                    limit = int(q.get("limit", ["1000"])[0])
                except ValueError:
                    self._json({"error": "start and limit must be integers"}, 400)
                    return
                try:
                    prefix = key_from_text(q.get("prefix", [""])[0])
                except ValueError as e:
                    self._json({"error": f"prefix: {e}"}, 400)
                    return
                reply = dispatcher.handle(p.ListKeys(prefix, start, limit))
                self._json({"error": reply.error} if reply.error else reply.data, 400 if reply.error else 200)
            else:
                self._json(
                    {
                        "error": f"no such endpoint {url.path}",
                        "endpoints": ["/health", "/metrics", "/capacity", "/keys", "POST /prefix"],
                    },
                    404,
                )

        def do_POST(self) -> None:
            url = urlparse(self.path)
            if url.path != "/prefix" or prefix is None:
                self._json({"error": f"no such endpoint POST {url.path}", "endpoints": ["POST /prefix"]}, 404)
                return
            try:
                n = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                n = -1
            if not 0 <= n <= MAX_BODY:
                self._json({"error": f"Content-Length: expected 0 to {MAX_BODY} bytes"}, 400)
                return
            code, out = prefix.answer(self.rfile.read(n))
            self._json(out, code)

    return Handler


class HttpEndpoint:
    """The HTTP server thread (``port`` 0 picks a free port; ``self.port`` tells which);
    ``health`` runs the node's checks for ``/health`` (``health.check_health``); ``prefix``
    answers ``POST /prefix`` (none: 404)."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        host: str,
        port: int,
        health: Callable[[], Health],
        prefix: PrefixQuery | None = None,
    ) -> None:
        self.server = ThreadingHTTPServer((host, port), _handler(dispatcher, health, prefix))
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(
            target=self.server.serve_forever, name="kvfabric-pool-http", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
