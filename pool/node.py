"""``PoolNode``: the service side of a pool on one node, and ``EmbeddedPool``.

A node owns the directory table (shared memory), the meta service and its dispatcher,
the pool's rendezvous store (a single-node server unless ``config.rendezvous`` names one),
and its rank in the pool's GVA fabric: rank 0, with a DRAM window of its own unless
``config.dram`` is 0. Every client joins the same fabric; the node follows its segment
table (joins, leaves, deaths) into the directory. The daemon (``daemon.py``) serves the
node over RPC; ``EmbeddedPool`` serves it in-process (nothing to start), with a thread
that expires leases.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from typing import Any

from kvfabric.platform import shm
from kvfabric.platform.base import Platform
from kvfabric.platform.buffer import Buffer
from kvfabric.platform.registry import create as create_platform
from kvfabric.platform.types import Medium
from kvfabric.pool import table as tbl
from kvfabric.pool.client import PoolClient, gva_config
from kvfabric.pool.config import PoolConfig
from kvfabric.pool.dispatch import Dispatcher
from kvfabric.pool.gva.fabric import Fabric
from kvfabric.pool.gva.rendezvous.server import RendezvousServer
from kvfabric.pool.meta import MetaService
from kvfabric.pool.rpc import LocalTransport
from kvfabric.pool.windows import FixedStride

log = logging.getLogger("kvfabric.pool")


class PoolNode:
    """See module docstring. ``close()`` leaves the fabric and releases the rendezvous
    server, the table, the window and the platform (if the node created it)."""

    def __init__(
        self, config: PoolConfig | None = None, platform: Platform | None = None, persistent: bool = False
    ) -> None:
        self.config = config or PoolConfig()
        self.persistent = persistent
        self._own_platform = platform is None
        self.platform = platform or create_platform()
        self.addressing = FixedStride()
        self.window: Buffer | None = None
        self.rdv: RendezvousServer | None = None
        self.fabric: Fabric | None = None
        self._tmpdir: str | None = None
        self.rebuilt = 0
        adopted = False
        if persistent and self.config.dram:
            self.window, created = self.platform.alloc_named(self._name("window"), self.config.dram)
            adopted = not created
        epoch = int.from_bytes(os.urandom(8), "little") | 1
        self.table = tbl.create(
            self.config.max_objects, name=self._name(f"table.{epoch:016x}") if persistent else None
        )
        try:
            self.service = MetaService(self.config, self.table, self.addressing)
            url = self.config.rendezvous or self._start_rendezvous()
            self.dispatcher = Dispatcher(
                self.service,
                self.table.epoch,
                {
                    "table": self.table.seg.name,
                    "table_bytes": self.table.seg.nbytes,
                    "name": self.config.name,
                    "platform": self.platform.name,
                    "stride": self.addressing.stride,
                    "rendezvous": url,
                    "namespace": f"kvfabric/pool/{self.config.name}",
                    "transports": self.config.transports,
                    "session_ttl_s": self.config.session_ttl_s,
                },
            )
            if self.config.dram:
                if self.window is None:
                    self.window = self.platform.alloc(self.config.dram, Medium.DRAM, shareable=True)
                if self.config.pretouch and not adopted:
                    _pretouch(self.window)
            windows: dict[Medium, Any] = {Medium.DRAM: self.window} if self.window is not None else {}
            self.fabric = Fabric.join(
                url, self.platform, windows, rank=0, config=gva_config(self.dispatcher.info())
            )
            self.fabric.subscribe(lambda change: self.dispatcher.apply_table(change.new))
            self.dispatcher.apply_table(self.fabric.table)
            if persistent:
                self.rebuilt = self._adopt_old_tables(rebuild=adopted)
        except BaseException:
            self.close()
            raise

    def _name(self, what: str) -> str:
        return f"pool-{self.config.name}-{what}"

    def _start_rendezvous(self) -> str:
        """The pool's single-node rendezvous store: TCP when the pool serves other nodes,
        else a Unix socket beside the RPC socket (or in a private directory, embedded)."""
        if self.config.tcp_addr is not None:
            self.rdv = RendezvousServer(
                self.config.tcp_addr[0], 0, session_ttl=self.config.session_ttl_s
            ).start()
            return self.rdv.url
        if self.persistent:
            path = self.config.socket + ".rdv"
            if os.path.exists(path):
                os.unlink(path)  # the daemon checked that no live daemon owns this pool
        else:
            self._tmpdir = tempfile.mkdtemp(prefix="kvfabric-pool-")
            path = os.path.join(self._tmpdir, "rdv.sock")
        self.rdv = RendezvousServer(unix_path=path, session_ttl=self.config.session_ttl_s).start()
        return self.rdv.url

    def _adopt_old_tables(self, rebuild: bool) -> int:
        """A restart after a crash: retire the previous tables (readers then fetch the new
        one) and, when this node's window survived, re-enter its readable objects."""
        prefix = shm.NAMED + self._name("table.")
        mine = self.table.seg.name
        rebuilt = 0
        for name in sorted(n for n in os.listdir(shm.shm_dir()) if n.startswith(prefix) and n != mine):
            try:
                old = tbl.attach_any(name)
            except Exception as e:  # noqa: BLE001 - a torn or foreign segment: just remove it
                log.warning("dropping unreadable old directory table %s: %s", name, e)
                shm.unlink_named(name[len(shm.NAMED) :])
                continue
            old.retire()
            if rebuild:
                rebuilt += self._rebuild_from(old)
            old.close()
            shm.unlink_named(name[len(shm.NAMED) :])
        if rebuilt:
            log.warning(
                "pool %r restarted: %d object(s) of its own window rebuilt", self.config.name, rebuilt
            )
        return rebuilt

    def _rebuild_from(self, old: tbl.TableView) -> int:
        import numpy as np

        w = self.service.windows.get((0, Medium.DRAM))
        if w is None:
            return 0
        s = old.slots
        live = np.flatnonzero(
            (s["hash"] != 0)
            & (s["state"] == int(tbl.SlotState.READABLE))
            & (s["gva"] >= w.lo)
            & (s["gva"] + s["size"] <= w.hi)
        )
        keys = [old.key_of(int(i)) for i in live]
        with self.dispatcher.lock:
            st = self.service.reregister(
                keys, s["gva"][live].tolist(), s["size"][live].tolist(), s["gen"][live].tolist()
            )
        return sum(1 for x in st if x == 0)

    def client(self, **kwargs: Any) -> PoolClient:
        """An in-process client (calls go straight to the dispatcher; it joins the fabric)."""
        return PoolClient(LocalTransport(self.dispatcher), self.platform, **kwargs)

    def close(self) -> None:
        """Release everything the node holds. Idempotent."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        if self.fabric is not None:
            self.fabric.leave()
        if self.rdv is not None:
            self.rdv.close()
        if self._tmpdir is not None:
            import shutil

            shutil.rmtree(self._tmpdir, ignore_errors=True)
        if self.window is not None and not self.window.freed:
            self.platform.free(self.window)
            if self.persistent:
                self.platform.unlink_named(self._name("window"))
        seg = self.table.seg
        self.table.close()
        if seg.owner:
            seg.unlink()
        else:
            shm.unlink_named(seg.name[len(shm.NAMED) :])
        if self._own_platform:
            self.platform.close()


def _pretouch(buf: Buffer) -> None:
    """Fault the window's pages in once now, not on the first puts (first touch of fresh
    shared memory runs below 1 GB/s)."""
    import time

    t0 = time.perf_counter()
    view = buf.numpy()
    step = 64 << 20
    for off in range(0, buf.nbytes, step):
        view[off : off + step] = 0
    log.info("pre-touched the %d MiB DRAM window in %.2f s", buf.nbytes >> 20, time.perf_counter() - t0)


class EmbeddedPool(PoolNode):
    """A whole pool inside one process (see module docstring)."""

    def __init__(self, config: PoolConfig | None = None, platform: Platform | None = None) -> None:
        super().__init__(config, platform)
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="kvfabric-pool-tick", daemon=True)
        self._ticker.start()

    def _tick(self) -> None:
        while not self._stop.wait(0.1):
            self.dispatcher.tick()

    def close(self) -> None:
        if hasattr(self, "_stop"):
            self._stop.set()
            self._ticker.join(2)
        super().close()

    def __enter__(self) -> EmbeddedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
