"""Building the connector's stores: the workers' movers and the scheduler's index.

vLLM builds a scheduler connector and worker connectors. With the engine in one process
(the CPU build with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, or TP=1 with the ``uni``
executor) they share that process and must see the same store, or a block a worker just
dumped into the ``cache`` tier would be invisible to the scheduler's lookups:
:func:`acquire` hands out one store per (configuration, layout) and process, reference
counted, and :class:`SchedulerIndex` answers from it. With the engine in several processes
(vLLM's multiprocessing executor, every TP rank) each worker builds its store and the
scheduler an index (``store.index``: lookups only; no cache, no copy threads, no data-path
pool client) of the shared tier where they meet: a ``posix`` directory, or a pool daemon.
A store that cannot be shared across processes (a ``cache`` alone, an embedded pool) is
refused at start-up by :func:`check_shared`, naming the fix.

The pool with no ``pool_address``: ``embedded`` in a one-process engine, else ``auto``
(``ConnectorConfig.placed``): the first process to build a store or an index starts the
node's pool daemon (``kvfabric.pool.autostart``, ``pool_bytes``, exits ``pool_idle_exit_s``
after its last client) and the others join it. Where the pool lives is logged once per
process (INFO).

The store names and their keys belong to ``kvfabric.ucm_layer.store`` (the store
registry); this module only maps the connector's configuration onto them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvfabric.platform.base import Platform
from kvfabric.ucm_layer.connector.config import AUTO, EMBEDDED, ConnectorConfig
from kvfabric.ucm_layer.store.base import Index, Store, StoreLayout

log = logging.getLogger("kvfabric.connector")

_lock = threading.Lock()
_told: set[str] = set()  # where-the-pool-lives lines already logged by this process
_told_lock = threading.Lock()  # not _lock: acquire() holds that while it builds


@dataclass
class _Entry:
    store: Store
    refs: int


_open: dict[tuple[str, StoreLayout], _Entry] = {}


def registered_stores() -> set[str]:
    """Names of the stores the store registry knows (empty if it cannot be imported)."""
    try:
        from kvfabric.ucm_layer.store import registry
    except ImportError:
        return set()
    return set(registry.available())


def store_config(cfg: ConnectorConfig) -> dict[str, Any]:
    """The flat ``"<store>.<key>"`` mapping the registry builds the pipeline from."""
    names = set(cfg.stores)
    out: dict[str, Any] = {"store": cfg.store}
    if "posix" in names:
        out["posix.dirs"] = cfg.posix_path
    if "cache" in names:
        out["cache.capacity"] = cfg.cache_bytes
    if "pool" in names:
        if cfg.pool_address == AUTO:
            from kvfabric.pool.autostart import socket_path

            out["pool.socket"] = socket_path(cfg.pool_name)
        elif cfg.pool_address and cfg.pool_address.startswith("/"):
            out["pool.socket"] = cfg.pool_address
        elif cfg.pool_address and cfg.pool_address != EMBEDDED:
            out["pool.tcp"] = cfg.pool_address
        else:
            out["pool.embedded_dram"] = cfg.pool_bytes
    out.update(cfg.store_options)
    return out


def _key(cfg: ConnectorConfig) -> str:
    return repr(sorted(store_config(cfg).items(), key=lambda kv: kv[0]))


def one_process(vllm_config: Any) -> bool:
    """Whether vLLM runs this engine's scheduler and its worker in one process: one rank,
    one data-parallel engine, and the ``uni`` executor (the CPU build switches to ``mp``,
    a process per worker, unless ``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    pc = getattr(vllm_config, "parallel_config", None)
    backend = getattr(pc, "distributed_executor_backend", None)
    world = int(getattr(pc, "world_size", 1) or 1)
    dp = int(getattr(pc, "data_parallel_size", 1) or 1)
    return world == 1 and dp == 1 and backend in (None, "uni")


def check_shared(cfg: ConnectorConfig, one_process: bool) -> None:
    """Refuse, at start-up, a store the engine's processes cannot share: its scheduler
    would never see what its workers store (a zero hit rate, silently)."""
    from kvfabric.ucm_layer.store import registry

    if one_process:
        return
    why = registry.unshared_reason(cfg.store, store_config(cfg))
    if why:
        raise ValueError(
            f"kvfabric: {why}, but this engine runs its scheduler and workers in separate processes "
            "(vLLM's multiprocessing executor or TP > 1), so its lookups would never see a block its "
            "workers stored. Use 'store': 'cache|pool' (without pool_address: a pool daemon on this "
            "node shared by the processes) or 'cache|posix', or run the engine in one process "
            "(VLLM_ENABLE_V1_MULTIPROCESSING=0 with TP=1)"
        )


def ensure_pool(cfg: ConnectorConfig, platform: Platform) -> None:
    """With ``pool_address`` ``auto``: the node's pool daemon, started if none answers.
    Logs once per process where the pool lives (also for the other placements)."""
    if "pool" not in cfg.stores:
        return
    named = cfg.store_options.get("pool.socket") or cfg.store_options.get("pool.tcp")
    if named or cfg.pool_address not in (None, AUTO, EMBEDDED):
        _tell(
            str(named or cfg.pool_address),
            "kvfabric: the pool is the daemon at %s",
            named or cfg.pool_address,
        )
        return
    if cfg.pool_address != AUTO:
        _tell(EMBEDDED, "kvfabric: the pool is embedded in this process (%d MiB)", cfg.pool_bytes >> 20)
        return
    from kvfabric.pool.autostart import AutoPool, ensure

    loc = ensure(
        AutoPool(cfg.pool_name, cfg.pool_bytes, exit_when_idle_s=cfg.pool_idle_exit_s, platform=platform.name)
    )
    _tell(
        loc.socket,
        "kvfabric: the pool is the node's daemon at %s (pid %s, %s by this process; it exits %s after "
        "its last client)",
        loc.socket,
        loc.pid,
        "started" if loc.started else "joined, not started",
        f"{cfg.pool_idle_exit_s:g} s" if cfg.pool_idle_exit_s else "never",
    )


def _tell(key: str, msg: str, *args: object) -> None:
    with _told_lock:
        if key in _told:
            return
        _told.add(key)
    log.info(msg, *args)


def build(cfg: ConnectorConfig, platform: Platform, layout: StoreLayout) -> Store:
    """A new store pipeline for ``cfg`` (not shared)."""
    from kvfabric.ucm_layer.store import registry

    ensure_pool(cfg, platform)
    return registry.create(config=store_config(cfg), platform=platform, layout=layout)


def open_index(cfg: ConnectorConfig, platform: Platform, layout: StoreLayout) -> Index:
    """A new index of the tier ``cfg``'s processes share (``registry.create_index``)."""
    from kvfabric.ucm_layer.store import registry

    ensure_pool(cfg, platform)
    return registry.create_index(config=store_config(cfg), platform=platform, layout=layout)


def acquire(
    cfg: ConnectorConfig,
    platform: Platform,
    layout: StoreLayout,
    builder: Callable[[ConnectorConfig, Platform, StoreLayout], Store] = build,
) -> Store:
    """This process's store for ``cfg`` and ``layout``; pair every call with :func:`release`."""
    key = (_key(cfg), layout)
    with _lock:
        entry = _open.get(key)
        if entry is None:
            entry = _open[key] = _Entry(builder(cfg, platform, layout), 0)
        entry.refs += 1
        return entry.store


def find(cfg: ConnectorConfig) -> Store | None:
    """Any open store of this configuration in this process (for lookups)."""
    k = _key(cfg)
    with _lock:
        for (key, _), entry in _open.items():
            if key == k:
                return entry.store
    return None


def release(store: Store) -> None:
    """Drop one reference; the last one closes the store."""
    with _lock:
        for key, entry in list(_open.items()):
            if entry.store is store:
                entry.refs -= 1
                if entry.refs > 0:
                    return
                del _open[key]
                break
        else:
            return
    store.close()


class SchedulerIndex:
    """The scheduler role's lookups (``lookup_prefix``), opened on first use: a store a
    worker of this process already opened for the same configuration (one-process
    engines: it covers the private ``cache`` tier too), else an index of the shared tier
    (never a store). A one-process engine whose store is unshared and not opened yet has
    nothing stored: a miss. ``lookup`` answers per block (several KV cache groups).
    ``layout``: the shard count a block needs complete (and the piece sizes, for a store
    registered without an index). ``close()`` closes only what this object opened."""

    def __init__(self, cfg: ConnectorConfig, platform: Platform, layout: StoreLayout) -> None:
        self.cfg, self.platform, self.layout = cfg, platform, layout
        self.index: Index | None = None
        self._own = False

    def _open(self) -> Index | None:
        if self.index is None:
            from kvfabric.ucm_layer.store import registry

            found = find(self.cfg)
            if found is not None:
                self.index = found
            elif registry.unshared_reason(self.cfg.store, store_config(self.cfg)):
                return None
            else:
                self.index, self._own = open_index(self.cfg, self.platform, self.layout), True
        return self.index

    def lookup_prefix(self, ids: np.ndarray) -> int:
        index = self._open()
        return 0 if index is None else index.lookup_prefix(ids)

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Which of ``ids`` the store holds (all False while there is nothing to ask)."""
        index = self._open()
        if index is None:
            return np.zeros(np.asarray(ids).reshape(-1, 16).shape[0], bool)
        return np.asarray(index.lookup(ids), bool)

    def close(self) -> None:
        index, self.index = self.index, None
        if index is not None and self._own:
            index.close()
