"""Indexes: the read-only metadata side of the shared stores (``base.Index``).

A scheduler counts the blocks a store holds; it never moves their bytes. An index
answers ``lookup`` / ``lookup_prefix`` exactly as the store's movers see the store, and
holds nothing a mover needs: no buffers, no copy threads, no data-path connection.

* ``posix``: :class:`PosixIndex` checks the final names of the block files (a file exists
  only once complete), in the same directories the store writes.
* ``pool``: :class:`PoolIndex` is a metadata-only pool client (no fabric rank, no window):
  on the pool's node it reads the daemon's directory table in shared memory (no RPC per
  lookup); elsewhere it asks the daemon (one ``Exists`` RPC per lookup). A block counts
  once every shard's object is committed. A pool that does not answer is a miss, logged
  once until it answers again.

Not every store can be indexed from another process: the ``cache`` tier lives in one
process's memory, and so does an embedded pool (``unshared``). Build indexes with
``registry.create_index``, which indexes a pipeline's lower store (a block becomes visible
only once the lowest tier has it) and refuses the unshareable ones with
:class:`UnsharedStore`. Thread-safe; ``close()`` is idempotent, any later call a
``ValueError``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

from kvfabric.errors import KVFabricError, ServiceUnavailable
from kvfabric.platform.base import Platform
from kvfabric.ucm_layer.store.base import StoreLayout, check_ids, present_prefix

log = logging.getLogger("kvfabric.store")


class UnsharedStore(KVFabricError, ValueError):
    """The store keeps its blocks in one process: no other process can index it."""


class _Index:
    name = "abstract"

    def __init__(self) -> None:
        self._closed = False

    def _ids(self, ids: Any) -> np.ndarray:
        if self._closed:
            raise ValueError(f"the {self.name} index is closed")
        return check_ids(ids)

    def lookup_prefix(self, ids: np.ndarray) -> int:
        return present_prefix(self.lookup(ids))

    def lookup(self, ids: np.ndarray) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def close(self) -> None:
        self._closed = True

    @classmethod
    def unshared(cls, config: Mapping[str, Any]) -> str | None:
        """Why this configuration keeps its blocks in one process, or None."""
        return None


class PosixIndex(_Index):
    """Existence checks of a posix store's block files (see module docstring)."""

    name = "posix"

    def __init__(self, dirs: tuple[str, ...]) -> None:
        from kvfabric.ucm_layer.store.posix_files import BlockFiles

        super().__init__()
        self.files = BlockFiles(dirs)

    @classmethod
    def from_config(cls, config: Mapping[str, Any], *, platform: Platform, layout: StoreLayout) -> PosixIndex:
        from kvfabric.ucm_layer.store.posix import PosixConfig

        return cls(PosixConfig.from_mapping(config).dirs)

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        return self.files.exists(self.files.paths(self._ids(ids)))


class PoolIndex(_Index):
    """A metadata-only client of a pool daemon (see module docstring)."""

    name = "pool"

    def __init__(self, client: Any, prefix: str, num_shards: int) -> None:
        super().__init__()
        self.client, self.prefix, self.num_shards = client, prefix, num_shards
        self._warned = False

    @classmethod
    def unshared(cls, config: Mapping[str, Any]) -> str | None:
        from kvfabric.ucm_layer.store.pool import PoolStoreConfig

        cfg = PoolStoreConfig.from_mapping(config)  # flat or nested keys, checked
        if cfg.socket or cfg.tcp:
            return None
        return "the pool store without pool.socket or pool.tcp embeds a pool in each process"

    @classmethod
    def from_config(cls, config: Mapping[str, Any], *, platform: Platform, layout: StoreLayout) -> PoolIndex:
        from kvfabric.ucm_layer.store.pool import PoolStoreConfig

        why = cls.unshared(config)
        if why:
            raise UnsharedStore(why)
        cfg = PoolStoreConfig.from_mapping(config)
        client = cfg.connect(platform, metadata_only=True)
        return cls(client, cfg.prefix, layout.num_shards)

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        from kvfabric.ucm_layer.store.pool import present_all_shards

        arr = self._ids(ids)
        if arr.shape[0] == 0:
            return np.zeros(0, bool)
        try:
            present = present_all_shards(self.client, self.prefix, arr, self.num_shards)
        except (ServiceUnavailable, KVFabricError) as e:
            if not self._warned:
                self._warned = True
                log.warning("kvfabric pool index: the pool did not answer (%s); treating it as a miss", e)
            return np.zeros(arr.shape[0], bool)
        self._warned = False
        return present

    def close(self) -> None:
        if not self._closed:
            super().close()
            self.client.close()
