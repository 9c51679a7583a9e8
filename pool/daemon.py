"""``kvfabric pool serve``: the pool daemon of one node.

Hosts the meta service (RPC on a Unix socket, mode 0600, and optionally TCP), the
directory table and, by default, a DRAM window of its own, plus the optional HTTP
endpoint. SIGTERM / SIGINT shut it down cleanly: RPC stops, shared segments are
unlinked, the socket file is removed.

Crash and restart: the window and the directory table are named shared-memory segments
that outlive the process. A daemon started after a crash re-attaches its window, retires
the old table (clients reading it notice and fetch the new one), re-enters every readable
object of its own window from the old table, and takes the re-registrations of the other
ranks' objects as their clients reconnect. Readers never act on a half-rebuilt table: they
use the old one until it is retired, and the new one only holds complete entries.
Refuses to start when another daemon already answers on the same socket.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
from typing import Any

from kvfabric.errors import ServiceUnavailable
from kvfabric.platform.base import Platform
from kvfabric.pool import protocol as p
from kvfabric.pool.config import PoolConfig
from kvfabric.pool.http import HttpEndpoint
from kvfabric.pool.node import PoolNode
from kvfabric.pool.rpc import SocketTransport
from kvfabric.pool.server import RpcServer

log = logging.getLogger("kvfabric.pool")


class PoolDaemon:
    """See module docstring. ``start()`` returns once RPC (and HTTP) answer."""

    def __init__(self, config: PoolConfig, platform: Platform | None = None) -> None:
        self.config = config
        self._check_not_running()
        self.node = PoolNode(config, platform, persistent=True)
        self.rpc = RpcServer(
            self.node.dispatcher, config.socket, config.tcp_addr, config.token, config.rpc_spin_us
        )
        self.http: HttpEndpoint | None = None
        self._stopped = threading.Event()

    def _check_not_running(self) -> None:
        probe = SocketTransport(self.config.socket, timeout=0.3)
        try:
            probe.call(p.Info())
        except ServiceUnavailable:
            return
        finally:
            probe.close()
        raise ValueError(f"a pool daemon already serves {self.config.socket}")

    def start(self) -> None:
        try:
            self.rpc.start()
            if self.config.http_addr is not None:
                self.http = HttpEndpoint(self.node.dispatcher, *self.config.http_addr)
                self.http.start()
        except BaseException:
            self.stop()
            raise
        log.info(
            "kvfabric pool %r serving on %s%s%s; effective config: %s",
            self.config.name,
            self.config.socket,
            f", tcp port {self.rpc.tcp_port}" if self.rpc.tcp_port is not None else "",
            f", http port {self.http.port}" if self.http else "",
            json.dumps(self.config.effective()),
        )

    def endpoints(self) -> dict[str, Any]:
        return {
            "socket": self.config.socket,
            "tcp_port": self.rpc.tcp_port,
            "http_port": self.http.port if self.http else None,
        }

    def serve_forever(self) -> None:
        """Block until SIGTERM/SIGINT (or ``stop()``), then shut down cleanly."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self._stopped.set())
        self._stopped.wait()
        self.stop()

    def stop(self) -> None:
        self._stopped.set()
        self.rpc.stop()
        if self.http is not None:
            self.http.stop()
            self.http = None
        self.node.close()
        log.info("kvfabric pool %r stopped", self.config.name)
