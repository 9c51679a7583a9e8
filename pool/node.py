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

    def __init__(self, config: PoolConfig | None = None, platform: Platform | None = None) -> None:
        self.config = config or PoolConfig()
        self._own_platform = platform is None
        self.platform = platform or create_platform()
        self.addressing = FixedStride()
        self.table = tbl.create(self.config.max_objects)
        self.window: Buffer | None = None
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
                self.window = self.platform.alloc(self.config.dram, Medium.DRAM, shareable=True)
                if self.config.pretouch:
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
        except BaseException:
            self.close()
            raise

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
        seg = self.table.seg
        self.table.close()
        seg.unlink()
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
