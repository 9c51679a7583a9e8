"""Building the connector's store pipeline, shared by the roles of one process.

vLLM builds a scheduler connector and a worker connector; with one engine process (the
CPU build, or TP=1) both live in one process and must see the same store, or a block a
worker just dumped into the ``cache`` tier would be invisible to the scheduler's
lookups. :func:`acquire` hands out one store per (configuration, layout) and process,
reference counted; :func:`find` gives the scheduler any store of its configuration that
a worker of this process already opened (lookups do not depend on the piece layout).
With several processes the roles build their own instances and meet in the shared
tiers (``posix`` directories, the pool).

The store names and their keys belong to ``kvfabric.ucm_layer.store`` (the store
registry); this module only maps the connector's configuration onto them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvfabric.platform.base import Platform
from kvfabric.ucm_layer.connector.config import ConnectorConfig
from kvfabric.ucm_layer.store.base import Store, StoreLayout

_lock = threading.Lock()


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
        if cfg.pool_address and cfg.pool_address.startswith("/"):
            out["pool.socket"] = cfg.pool_address
        elif cfg.pool_address:
            out["pool.tcp"] = cfg.pool_address
        else:
            out["pool.embedded_dram"] = cfg.pool_bytes
    out.update(cfg.store_options)
    return out


def _key(cfg: ConnectorConfig) -> str:
    return repr(sorted(store_config(cfg).items(), key=lambda kv: kv[0]))


def build(cfg: ConnectorConfig, platform: Platform, layout: StoreLayout) -> Store:
    """A new store pipeline for ``cfg`` (not shared)."""
    from kvfabric.ucm_layer.store import registry

    return registry.create(config=store_config(cfg), platform=platform, layout=layout)


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
