"""``kvfabric pool serve``: the pool daemon of one node.

Hosts the meta service (RPC on a Unix socket, mode 0600, and optionally TCP), the
directory table and, by default, a DRAM window of its own, plus the optional HTTP
endpoint. SIGTERM / SIGINT shut it down cleanly: RPC stops, shared segments are
unlinked, the socket file is removed.

One daemon per socket and per pool name: before it touches anything the daemon takes
two locks (``lock.py``: ``flock`` on ``<socket>.lock`` and on ``.kvf-pool-<name>.lock``
in the shared-memory directory) and holds them until it has cleaned up. A second daemon
is refused at once with an error naming the running one's pid (exit status 2), and
removes nothing: the socket, the rendezvous socket and the segments are only ever
created and removed by the lock's holder. The kernel drops the locks of a daemon that
dies, however it dies, so a crash never blocks the next start.

Signals: the command installs its SIGTERM / SIGINT handler (:class:`Signals`) before
anything is allocated. The handler only records the signal. Start-up passes a
checkpoint after each :class:`~kvfabric.pool.service.node.StartStage` and abandons the start at
the first one after a signal (:class:`StartInterrupted`, exit status 128 + signal): every
segment the start created is removed then, and the locks released. Once serving, the
same signal stops the daemon cleanly (exit status 0). A failed start of any other kind
cleans up the same way.

Crash and restart: the window and the directory table are named shared-memory segments
that outlive the process. A daemon started after a crash re-attaches its window, retires
the old table (clients reading it notice and fetch the new one), re-enters every readable
object of its own window from the old table, and takes the re-registrations of the other
ranks' objects as their clients reconnect. Readers never act on a half-rebuilt table: they
use the old one until it is retired, and the new one only holds complete entries. The
ranks with windows are kept in ``<socket>.ranks`` while the daemon runs; the next start
reserves them for their owners' tokens, so a client that rejoins first cannot take a
rank whose objects belong to another (``PoolNode._reserve_ranks``).

Idle exit (``exit_when_idle_s``, off by default; the daemons the vLLM connector starts on
its own turn it on, ``kvfabric.pool.autostart``): the daemon stops cleanly, as on SIGTERM,
once it has had no client for that long: no open RPC connection and no fabric rank but its
own. The time before the first client connects counts as idle.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from typing import Any

from kvfabric.errors import KVFabricError
from kvfabric.platform import shm
from kvfabric.platform.base import Platform
from kvfabric.pool.config import PoolConfig
from kvfabric.pool.service.health import check_health
from kvfabric.pool.service.http import HttpEndpoint
from kvfabric.pool.service.lock import PidLock
from kvfabric.pool.service.node import PoolNode, StartStage
from kvfabric.pool.service.server import RpcServer

log = logging.getLogger("kvfabric.pool")

_SIGNALS = (signal.SIGTERM, signal.SIGINT)
IDLE_POLL_S = 0.5  # how often an idle-exiting daemon counts its clients


class StartInterrupted(KVFabricError):
    """A signal arrived during start-up; the start was abandoned and cleaned up."""

    def __init__(self, signum: int, stage: StartStage) -> None:
        super().__init__(f"start-up abandoned after stage {stage.value!r}: {signal.Signals(signum).name}")
        self.signum = signum
        self.stage = stage


class Signals:
    """SIGTERM / SIGINT recorded for the daemon (see module docstring).

    ``install()`` from the main thread before the daemon is built; ``signum`` is the
    first signal received (later ones are ignored: cleanup is already under way) and
    ``event`` is set by it, or by ``PoolDaemon.stop()``."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signum: int | None = None
        self.installed = False

    def install(self) -> None:
        for sig in _SIGNALS:
            signal.signal(sig, self._handle)
        self.installed = True

    def _handle(self, signum: int, _frame: object) -> None:
        if self.signum is None:
            self.signum = signum
        self.event.set()


class PoolDaemon:
    """See module docstring. Construction takes the locks and builds the node;
    ``start()`` returns once RPC (and HTTP) answer; ``serve_forever()`` blocks until a
    signal or ``stop()``. ``pause_at``: a test hook that prints
    ``{"event": "paused", "stage": ...}`` after that stage and waits for a signal."""

    def __init__(
        self,
        config: PoolConfig,
        platform: Platform | None = None,
        signals: Signals | None = None,
        pause_at: StartStage | None = None,
    ) -> None:
        self.config = config
        self.signals = signals or Signals()
        self._pause_at = pause_at
        self._locks: list[PidLock] = []
        self._stopped = False
        self.node: PoolNode | None = None
        self.rpc: RpcServer | None = None
        self.http: HttpEndpoint | None = None
        try:
            self._take_locks()
            self._checkpoint(StartStage.LOCKED)
            self.node = PoolNode(config, platform, persistent=True, checkpoint=self._checkpoint)
            self.rpc = RpcServer(
                self.node.dispatcher,
                config.socket,
                config.tcp_addr,
                config.token,
                config.rpc_spin_us,
                insecure=config.insecure,
            )
        except BaseException:
            self.stop()
            raise

    def _take_locks(self) -> None:
        sock, name, shm_dir = self.config.socket, self.config.name, shm.shm_dir()
        for d, what in ((os.path.dirname(os.path.abspath(sock)), "socket"), (shm_dir, "shared-memory")):
            if not os.path.isdir(d):
                raise ValueError(f"the pool's {what} directory {d!r} does not exist")
        self._locks.append(PidLock.acquire(f"{sock}.lock", "a pool daemon", f"already serves {sock}"))
        self._locks.append(
            PidLock.acquire(
                os.path.join(shm_dir, f".kvf-pool-{name}.lock"),
                "a pool daemon",
                f"already runs pool {name!r} (segments in {shm_dir})",
            )
        )

    def _checkpoint(self, stage: StartStage) -> None:
        """After each start-up stage: pause there if asked to, abandon after a signal."""
        if stage is self._pause_at:
            self._pause_at = None
            print(json.dumps({"event": "paused", "stage": stage.value}), flush=True)
            self.signals.event.wait()
        if self.signals.signum is not None:
            raise StartInterrupted(self.signals.signum, stage)

    def start(self) -> None:
        assert self.node is not None and self.rpc is not None
        try:
            self.rpc.start()
            if self.config.leader_election and self.rpc.tcp_port is not None:
                self.node.start_election(self.rpc.tcp_port)  # stands by until elected
            self._checkpoint(StartStage.RPC)
            if self.config.http_addr is not None:
                node = self.node
                self.http = HttpEndpoint(
                    node.dispatcher, *self.config.http_addr, lambda: check_health(node), node.prefix_query()
                )
                self.http.start()
            self._checkpoint(StartStage.HTTP)
        except BaseException:
            self.stop()
            raise
        self.node.serving = True
        log.info(
            "kvfabric pool %r serving on %s%s%s (pid %d); effective config: %s",
            self.config.name,
            self.config.socket,
            f", tcp port {self.rpc.tcp_port}" if self.rpc.tcp_port is not None else "",
            f", http port {self.http.port}" if self.http else "",
            os.getpid(),
            json.dumps(self.config.effective()),
        )

    def endpoints(self) -> dict[str, Any]:
        return {
            "socket": self.config.socket,
            "tcp_port": self.rpc.tcp_port if self.rpc else None,
            "http_port": self.http.port if self.http else None,
            "pid": os.getpid(),
            **self._kv_events_endpoints(),
        }

    def _kv_events_endpoints(self) -> dict[str, str | None]:
        """The KV event sockets as bound (a port 0 resolved), when the publisher runs."""
        pub = self.node.events if self.node is not None else None
        if pub is None:
            return {}
        return {"kv_events_endpoint": pub.endpoint, "kv_events_replay_endpoint": pub.replay_endpoint}

    def serve_forever(self) -> None:
        """Block until SIGTERM/SIGINT (or ``stop()``), then shut down cleanly. Installs
        the signal handler itself if the caller did not (main thread only). With
        ``exit_when_idle_s`` set, also returns (and shuts down) once no client has been
        connected for that long (:meth:`holders`)."""
        if not self.signals.installed:
            self.signals.install()
        grace = self.config.exit_when_idle_s
        if not grace:
            self.signals.event.wait()
        else:
            idle_since: float | None = time.monotonic()  # the start counts as idle
            kept_by: list[str] = []
            while not self.signals.event.wait(min(IDLE_POLL_S, grace)):
                holders = self.holders()
                if holders != kept_by:  # who keeps it alive, in its log, as it changes
                    now_held = ", ".join(holders) or "none"
                    log.info("kvfabric pool %r: clients now: %s", self.config.name, now_held)
                    kept_by = holders
                if holders:
                    idle_since = None
                    continue
                now = time.monotonic()
                idle_since = now if idle_since is None else idle_since
                if now - idle_since >= grace:
                    log.info(
                        "kvfabric pool %r: no client for %.1f s (exit_when_idle_s); exiting",
                        self.config.name,
                        now - idle_since,
                    )
                    break
        self.stop()

    def holders(self) -> list[str]:
        """The clients that keep an idle-exiting daemon alive, one description each: open RPC
        connections (by peer process), and ranks of the pool's fabric other than the daemon's
        own (a client that joined but holds no RPC connection at the moment)."""
        pids = self.rpc.peer_pids() if self.rpc is not None else []
        fabric = self.node.fabric if self.node is not None else None
        members = [m for m in fabric.table.members if m.rank != fabric.rank] if fabric is not None else []
        return [f"rpc connection of pid {pid or '?'}" for pid in pids] + [
            f"fabric rank {m.rank} (pid {m.pid} on {m.node})" for m in members
        ]

    def stop(self) -> None:
        """Stop serving and release everything, the locks last. Idempotent; also the
        cleanup of a start that failed half-way."""
        if self._stopped:
            return
        self._stopped = True
        self.signals.event.set()
        if self.rpc is not None:
            self.rpc.stop()
        if self.http is not None:
            self.http.stop()
            self.http = None
        if self.node is not None:
            self.node.close()
        for lock in reversed(self._locks):
            lock.release()
        self._locks.clear()
        if self.node is not None:
            log.info("kvfabric pool %r stopped", self.config.name)
