"""The stores ``kvfabric bench pool`` measures, behind one small interface.

One registry (:class:`kvfabric.registry.Registry`, plugins: the ``kvfabric.peer_stores``
entry-point group): store name -> module, imported only when that store is measured (so
Mooncake's and Redis's client libraries load only in the processes that use them). Each
module provides

* ``missing() -> str | None``: why the store cannot run here (not installed ...), or None;
* ``start(capacity, workdir, options) -> Service``: start the store's server side with room
  for ``capacity`` bytes of objects (the caller stops it); ``Service.params`` is what a
  client process needs, ``Service.pids`` the server processes;
* ``Driver(params)``: a client, built inside each benchmark client process.

Driver contract (one client process, one thread): ``register`` every buffer before a call
uses addresses in it; ``call(op, keys, ptrs, sizes)`` builds, untimed, one call of
``len(keys)`` objects (``ptrs`` is ``(len(keys), pieces)`` addresses, ``sizes`` the
piece sizes), and returns a function that performs it and returns how many objects
failed; a batch of one uses the store's single-object call. Puts are put-if-absent of
fresh keys; gets copy into the caller's memory. ``exists`` answers how many keys are
stored; ``remove`` deletes keys (missing ones are ignored); ``close`` ends the client.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from kvfabric.bench.poolcase import Op
from kvfabric.registry import Registry

STORES: Registry[Any] = Registry(
    "peer store",
    {
        "kvfabric": "kvfabric.bench.stores.kvpool",
        "mooncake": "kvfabric.bench.stores.mooncake",
        "redis": "kvfabric.bench.stores.redis",
    },
)


class Driver(Protocol):
    def register(self, arr: np.ndarray) -> None: ...

    def call(self, op: Op, keys: list[str], ptrs: np.ndarray, sizes: np.ndarray) -> Callable[[], int]: ...

    def exists(self, keys: list[str]) -> int: ...

    def remove(self, keys: list[str]) -> None: ...

    def close(self) -> None: ...


class Service(Protocol):
    params: dict[str, Any]
    pids: list[int]

    def stop(self) -> None: ...


def module(store: str) -> Any:
    return STORES.load(store)


def open_driver(store: str, params: dict[str, Any]) -> Driver:
    return module(store).Driver(params)


def die_with_parent() -> None:
    """``preexec_fn`` for server subprocesses: SIGTERM them if the benchmark process dies
    (Linux ``PR_SET_PDEATHSIG``), so a killed run leaves no server behind."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def chunks(items: list[Any], n: int) -> list[list[Any]]:
    return [items[i : i + n] for i in range(0, len(items), n)]
