"""Mooncake Store as a benchmark store (``mooncake-transfer-engine``, TCP protocol).

Client side only; the services (HTTP metadata server, master, the store process that
contributes the memory) and the loopback-only network namespace they need are in
:mod:`kvfabric.bench.stores.mooncake_host`, which runs the whole Mooncake part of a run.

Two shapes (``params["segment"]``): ``0`` — the client contributes no memory and objects
live in another process's segment (the store process), which mirrors the pool daemon
owning the memory; ``> 0`` — embedded: the client mounts a segment of its own and its
objects land there. Zero-copy calls on registered buffers: ``put_from`` / ``get_into``,
``batch_put_from`` / ``batch_get_into``, and for layered objects the multi-buffer batch
calls (one key with many pieces).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from kvfabric.bench.poolcase import Op
from kvfabric.bench.stores import chunks
from kvfabric.harness.procs import free_port

LOCAL_BUFFER = 16 << 20


def missing() -> str | None:
    if importlib.util.find_spec("mooncake") is None:
        return "mooncake-transfer-engine is not installed (pip install 'kvfabric[mooncake]')"
    return None


def setup_store(segment: int) -> Any:
    """A connected ``MooncakeDistributedStore`` contributing ``segment`` bytes (0: none).
    Needs ``MC_TCP_BIND_ADDRESS`` and the services of ``mooncake_host`` (their addresses
    in ``KVF_MC_METADATA`` / ``KVF_MC_MASTER``)."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(
        f"127.0.0.1:{free_port()}",
        os.environ["KVF_MC_METADATA"],
        int(segment),
        LOCAL_BUFFER,
        "tcp",
        "",
        os.environ["KVF_MC_MASTER"],
    )
    if rc != 0:
        raise RuntimeError(f"MooncakeDistributedStore.setup failed with code {rc}")
    return store


class Driver:
    """A Mooncake Store client (see the store contract in ``kvfabric.bench.stores``)."""

    def __init__(self, params: dict[str, Any]) -> None:
        self.store = setup_store(int(params.get("segment", 0)))
        self.last_failure = ""  # the codes of the last call that failed, for the report

    def register(self, arr: np.ndarray) -> None:
        rc = self.store.register_buffer(arr.ctypes.data, arr.nbytes)
        if rc != 0:
            raise RuntimeError(f"Mooncake register_buffer failed with code {rc}")

    def _failed(self, codes: list[int], ok: int | None) -> int:
        """Failures among return codes (``ok``: the code of success; None: the size)."""
        bad = [c for c in codes if (c != ok if ok is not None else c < 0)]
        if bad:
            self.last_failure = f"mooncake codes {sorted(set(bad))[:4]}"
        return len(bad)

    def call(self, op: Op, keys: list[str], ptrs: np.ndarray, sizes: np.ndarray) -> Callable[[], int]:
        s, f = self.store, self._failed
        k, m = ptrs.shape
        want = int(sizes.sum())
        if m == 1:
            pl, n = [int(p) for p in ptrs[:, 0]], int(sizes[0])
            sl = [n] * k
            if op is Op.PUT:
                if k == 1:
                    key, p = keys[0], pl[0]
                    return lambda: f([s.put_from(key, p, n)], 0)
                return lambda: f(s.batch_put_from(keys, pl, sl), 0)
            if op is Op.GET:
                if k == 1:
                    key, p = keys[0], pl[0]
                    return lambda: f([s.get_into(key, p, n)], want)
                return lambda: f(s.batch_get_into(keys, pl, sl), want)
        else:
            pp = [[int(p) for p in row] for row in ptrs]
            ss = [[int(x) for x in sizes]] * k
            if op is Op.PUT:
                return lambda: f(s.batch_put_from_multi_buffers(keys, pp, ss), 0)
            if op is Op.GET:
                return lambda: f(s.batch_get_into_multi_buffers(keys, pp, ss), want)
        raise ValueError(f"mooncake driver: no call for op {op!r}")

    def exists(self, keys: list[str]) -> int:
        return sum(1 for x in self.store.batch_is_exist(keys) if x == 1)

    def remove(self, keys: list[str]) -> None:
        for part in chunks(keys, 1024):
            self.store.batch_remove(part, True)

    def close(self) -> None:
        self.store.close()
