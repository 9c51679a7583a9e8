"""``PoolNode``: the service side of a pool on one node, and ``EmbeddedPool``.

A node owns the directory table (shared memory), the meta service and its dispatcher,
and, unless ``config.dram`` is 0, a DRAM window of its own as rank 0. The daemon
(``daemon.py``) serves it over RPC; ``EmbeddedPool`` serves it in-process (the default
for ``kvfabric demo``: nothing to start), with a thread that expires leases.
"""

from __future__ import annotations

import logging
import os
import threading

from kvfabric.platform import shm
from kvfabric.platform.base import Platform
from kvfabric.platform.buffer import Buffer
from kvfabric.platform.registry import create as create_platform
from kvfabric.platform.types import Medium
from kvfabric.pool import protocol as p
from kvfabric.pool import table as tbl
from kvfabric.pool.client import PoolClient
from kvfabric.pool.config import PoolConfig
from kvfabric.pool.dispatch import Dispatcher
from kvfabric.pool.meta import MetaService
from kvfabric.pool.rpc import LocalTransport
from kvfabric.pool.windows import FixedStride

log = logging.getLogger("kvfabric.pool")


class PoolNode:
    """See module docstring. ``close()`` releases the table, the window and the platform
    (if the node created it)."""

    def __init__(
        self, config: PoolConfig | None = None, platform: Platform | None = None, persistent: bool = False
    ) -> None:
        self.config = config or PoolConfig()
        self.persistent = persistent
        self._own_platform = platform is None
        self.platform = platform or create_platform()
        self.addressing = FixedStride()
        self.window: Buffer | None = None
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
            self.dispatcher = Dispatcher(
                self.service,
                self.table.epoch,
                self.table.seg.name,
                self.table.seg.nbytes,
                extra_info={
                    "name": self.config.name,
                    "platform": self.platform.name,
                    "stride": self.addressing.stride,
                },
            )
            if self.config.dram:
                if self.window is None:
                    self.window = self.platform.alloc(self.config.dram, Medium.DRAM, shareable=True)
                if self.config.pretouch and not adopted:
                    _pretouch(self.window)
                self.dispatcher.handle(
                    p.AddWindow(
                        "service",
                        0,
                        Medium.DRAM.value,
                        self.config.dram,
                        self.platform.export_handle(self.window),
                        os.getpid(),
                    )
                )
            if persistent:
                self.rebuilt = self._adopt_old_tables(rebuild=adopted)
        except BaseException:
            self.close()
            raise

    def _name(self, what: str) -> str:
        return f"pool-{self.config.name}-{what}"

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
        st = self.service.reregister(
            keys, s["gva"][live].tolist(), s["size"][live].tolist(), s["gen"][live].tolist()
        )
        return sum(1 for x in st if x == 0)

    def client(self, **kwargs: object) -> PoolClient:
        """An in-process client (calls go straight to the dispatcher)."""
        return PoolClient(LocalTransport(self.dispatcher), self.platform, self.addressing, **kwargs)  # type: ignore[arg-type]

    def close(self) -> None:
        """Release the window, the table and (if created here) the platform. Idempotent."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
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
        self._stop.set()
        self._ticker.join(2)
        super().close()

    def __enter__(self) -> EmbeddedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
