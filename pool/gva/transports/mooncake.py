"""The Mooncake Transfer Engine behind the ``remote`` transport (``[mooncake]`` extra).

The only module that imports ``mooncake``. The engine runs in peer-to-peer handshake
mode (no metadata server: a rank's route is ``HOST:RPC_PORT``, published in its member
record), over ``tcp`` here and ``rdma`` in production (``GvaConfig.extra``:
``mooncake_protocol``, ``mooncake_device``). Memory must be registered with the engine
before it moves bytes: each rank registers its windows at join, and the transport
registers the local buffers a copy names on first use.

Note: the engine opens listeners on every interface whatever host it is given, and
advertises ``MC_TCP_BIND_ADDRESS`` when that is set; tests and benchmarks run it in a
loopback-only network namespace.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from kvfabric.errors import PlatformError, TransferFailed
from kvfabric.pool.gva.transports.base import DONE, Completion, ok_one


class MooncakeCompletion(Completion):
    """An asynchronous engine batch; ``transfer_check_status`` is read until final once."""

    __slots__ = ("_bid", "_engine", "_lock", "_state", "what")

    def __init__(self, engine: Any, bid: int, what: str) -> None:
        self._engine = engine
        self._bid = bid
        self._state = 0  # 0 running, 1 done, < 0 failed (engine codes)
        self._lock = threading.Lock()
        self.what = what

    def check(self) -> bool:
        with self._lock:
            if self._state == 0:
                self._state = int(self._engine.transfer_check_status(self._bid))
            return self._state != 0

    def wait(self, timeout: float | None = None) -> np.ndarray:
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        pause = 1e-5
        while not self.check():
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise TimeoutError(f"{self.what} still running after {timeout} s")
            time.sleep(pause if deadline is None else min(pause, max(deadline - now, 0.0)))
            # notice completion within ~0.1 ms of it, or 1 % of the wait so far when longer
            # (a peer that stopped answering is not polled 10^4 times a second)
            pause = min(pause * 1.5, max(1e-4, (now - start) / 100))
        if self._state < 0:
            kind = "timed out" if self._state == -2 else "failed"
            raise TransferFailed(f"{self.what} {kind} in the Mooncake transfer engine (status {self._state})")
        return ok_one()


class MooncakeEngine:
    """A started Mooncake ``TransferEngine`` (see module docstring)."""

    name = "mooncake"

    def __init__(self, host: str, protocol: str = "tcp", device: str = "") -> None:
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise PlatformError(
                "the remote transport needs Mooncake: pip install 'kvfabric[mooncake]' "
                f"(and Debian libibverbs1): {e}"
            ) from e
        self.engine = TransferEngine()
        rc = self.engine.initialize(host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise PlatformError(
                f"Mooncake TransferEngine.initialize({host!r}, P2PHANDSHAKE, {protocol!r}) -> {rc}"
            )
        self.route = f"{host}:{self.engine.get_rpc_port()}"
        self.protocol = protocol

    def register(self, ptr: int, nbytes: int, location: str) -> None:
        rc = self.engine.register_memory(ptr, nbytes, location)
        if rc != 0:
            raise PlatformError(f"Mooncake register_memory({ptr:#x}, {nbytes}, {location!r}) -> {rc}")

    def unregister(self, ptr: int) -> None:
        self.engine.unregister_memory(ptr)

    def transfer(
        self,
        route: str,
        write: bool,
        local: list[int],
        remote: list[int],
        sizes: list[int],
        sync: bool,
        what: str,
    ) -> Completion:
        e = self.engine
        if sync:
            if len(sizes) == 1:
                fn = e.transfer_sync_write if write else e.transfer_sync_read
                rc = fn(route, local[0], remote[0], sizes[0])
            else:
                fn = e.batch_transfer_sync_write if write else e.batch_transfer_sync_read
                rc = fn(route, local, remote, sizes)
            if rc != 0:
                raise TransferFailed(f"{what} failed in the Mooncake transfer engine (status {rc})")
            return DONE
        fn = e.batch_transfer_async_write if write else e.batch_transfer_async_read
        bid = fn(route, local, remote, sizes)
        if not bid or bid < 0:
            raise TransferFailed(f"{what}: the Mooncake transfer engine refused the batch (id {bid})")
        return MooncakeCompletion(e, bid, what)

    def close(self) -> None:
        self.engine = None
