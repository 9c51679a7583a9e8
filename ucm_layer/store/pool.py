"""``pool``: the kvfabric object pool as a KV block store.

One pool object per block shard, keyed by the bytes ``<prefix>/`` + the block's 16 id
bytes + the shard (2 bytes, big endian): binary keys built straight from the id array, one
``KeyBatch`` a chunk, checked once (``object_keys``).
A dump is one ``batch_put_from_layers`` per chunk of blocks (one alloc RPC, one batched
copy straight from the caller's ``m`` pieces into the pool's memory, one commit RPC); a
load is one ``batch_get_into_layers`` per chunk (on the pool's node: no RPC, a lookup in
the shared directory and one batched copy into the pieces). Objects are immutable and
put-if-absent, so concurrent dumps of one block are harmless and a block is visible only
once committed whole: a writer killed mid-dump leaves nothing visible (its allocation is
reclaimed when the write lease ends).

Where the pool is (keys ``pool.*``): ``pool.socket`` (or ``pool.tcp`` + ``pool.token``)
names a running daemon (``kvfabric pool serve``); with neither, the store starts an
embedded pool of ``pool.embedded_dram`` bytes in this process. A pool that does not
answer makes ``lookup`` a miss (logged once), loads ``MISSING`` and dumps ``FAILED``.

Integrity is the pool's: every object carries its writer's checksum and the client checks
it on reads (``pool.verify``: ``on`` / ``off``; unset, the daemon's setting). A read that
fails it is the pool's ``CORRUPT``, reported here as ``BlockStatus.CORRUPT`` and counted
in ``stats()["corrupt_blocks"]``.

Replicas: ``pool.replicas`` (0: the daemon's ``replicas``) copies of each block, placed by
the pool on distinct nodes; a load reads the copy on this node first and falls back to
another when one fails (``docs/pool.md``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from kvfabric.errors import KVFabricError, ServiceUnavailable
from kvfabric.platform.base import Platform
from kvfabric.platform.checksum import Verify
from kvfabric.pool.keys import KeyBatch, key_text
from kvfabric.settings import Size, setting
from kvfabric.ucm_layer.store.base import ID_BYTES, BlockStatus, StoreLayout
from kvfabric.ucm_layer.store.common import Request, TaskStore
from kvfabric.ucm_layer.store.config import StoreConfig, as_verify
from kvfabric.ucm_layer.store.task import StoreTask
from kvfabric.ucm_layer.store.workers import WorkerContext, Workers, dump_may_start

log = logging.getLogger("kvfabric.store")

# pool Status -> store BlockStatus
_OK, _EXISTS, _NOT_FOUND, _CORRUPT = 0, 1, 2, 8


def _as_verify_or_unset(v: Any) -> str:
    """``on`` / ``off``, or ``""``: the daemon's setting."""
    return "" if v is None or (isinstance(v, str) and not v.strip()) else as_verify(v).value


@dataclass(frozen=True)
class PoolStoreConfig(StoreConfig):
    """Configuration of the pool store (keys ``pool.*``; see docs/stores.md)."""

    PREFIX: ClassVar[str] = "pool"

    socket: str = setting("", doc="Unix socket of a pool daemon ('' with no tcp: an embedded pool)")
    tcp: str = setting("", doc="HOST:PORT of a pool daemon on another node")
    token: str = setting("", doc="shared secret of the daemon's TCP endpoint")
    name: str = setting("default", doc="pool name (its default socket, and the embedded pool's name)")
    prefix: str = setting("kv", doc="key prefix of this store's objects in the pool")
    window: Size = setting(0, doc="bytes this process contributes to the pool as a rank (0: none)")
    embedded_dram: Size = setting(1 << 30, doc="size of the embedded pool when no daemon is named")
    workers: int = setting(2, doc="threads that run the store's transfers", lo=1, hi=64)
    chunk: int = setting(64, doc="blocks per pool batch call", lo=1, hi=1 << 20)
    timeout: float = setting(1.0, doc="seconds before an unanswered pool call is a failure", lo=0.01)
    verify: str = setting(
        "", doc="reads check objects' checksums: on / off ('': the daemon's)", parse=_as_verify_or_unset
    )
    replicas: int = setting(
        0, doc="copies of each block, on distinct nodes (0: the daemon's replicas)", lo=0, hi=8
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("socket", "tcp", "token", "name", "prefix"):
            object.__setattr__(self, key, getattr(self, key).strip())
        if not self.prefix or "/" in self.prefix:
            raise ValueError(f"config key pool.prefix must be non-empty without '/', got {self.prefix!r}")

    def connect(self, platform: Platform, **client_kwargs: Any) -> Any:
        """A client of the daemon this config names (``pool.socket`` or ``pool.tcp``)."""
        from kvfabric.pool import connect

        return connect(
            self.socket or None,
            name=self.name,
            tcp=self.tcp or None,
            token=self.token,
            platform=platform,
            timeout=self.timeout,
            **client_kwargs,
        )


MAX_SHARDS = 1 << 16  # a shard is two bytes of the key


def object_keys(prefix: str, ids: np.ndarray, shard: int) -> KeyBatch:
    """The pool keys of shard ``shard`` of each block, as one checked batch: the bytes
    ``<prefix>/`` + the block's 16 id bytes + the shard (2 bytes, big endian)."""
    if isinstance(shard, bool) or not isinstance(shard, (int, np.integer)) or not 0 <= shard < MAX_SHARDS:
        raise ValueError(f"shard must be an int in [0, {MAX_SHARDS}), got {shard!r}")
    return KeyBatch.of_ids(f"{prefix}/".encode(), ids, int(shard).to_bytes(2, "big"), ID_BYTES)


def present_all_shards(client: Any, prefix: str, ids: np.ndarray, num_shards: int) -> np.ndarray:
    """Which blocks have every shard in the pool (``batch_exists``: one table lookup on
    the pool's node, one RPC elsewhere); raises what the client raises."""
    keys = KeyBatch.stack(object_keys(prefix, ids, s) for s in range(num_shards))
    return client.batch_exists(keys).reshape(num_shards, ids.shape[0]).all(axis=0)


class PoolStore(TaskStore):
    """The pool store (see module docstring)."""

    name = "pool"

    def __init__(self, config: PoolStoreConfig, *, platform: Platform, layout: StoreLayout) -> None:
        super().__init__(platform, layout)
        self.config = config
        self._embedded: Any = None
        self.client = self._connect(config, platform)
        self.verify = getattr(self.client, "verify", Verify.ON)
        self._sizes = layout.sizes
        self._warned = False
        self.workers = Workers(platform, config.workers, "kvfabric-poolstore")

    @classmethod
    def from_config(cls, config: Mapping[str, Any], **kwargs: Any) -> PoolStore:
        return cls(PoolStoreConfig.from_mapping(config), **kwargs)

    def _connect(self, cfg: PoolStoreConfig, platform: Platform) -> Any:
        kwargs: dict[str, Any] = {"window_bytes": cfg.window} if cfg.window else {}
        if cfg.verify:
            kwargs["verify"] = cfg.verify
        if cfg.replicas:
            kwargs["replicas"] = cfg.replicas
        if cfg.socket or cfg.tcp:
            return cfg.connect(platform, **kwargs)
        from kvfabric.pool.config import PoolConfig
        from kvfabric.pool.service.node import EmbeddedPool

        self._embedded = EmbeddedPool(PoolConfig(name=cfg.name, dram=cfg.embedded_dram), platform)
        return self._embedded.client(**kwargs)

    # ------------------------------------------------------------------ keys
    def keys(self, ids: np.ndarray, shard: int) -> KeyBatch:
        return object_keys(self.config.prefix, ids, shard)

    def _unavailable(self, e: Exception) -> None:
        if not self._warned:
            self._warned = True
            log.warning("kvfabric pool store: the pool did not answer (%s); treating it as a miss", e)

    # ------------------------------------------------------------------ contract
    def lookup(self, ids: np.ndarray) -> np.ndarray:
        arr = self._ids(ids)
        n = arr.shape[0]
        if n == 0:
            return np.zeros(0, bool)
        try:
            present = present_all_shards(self.client, self.config.prefix, arr, self.layout.num_shards)
        except (ServiceUnavailable, KVFabricError) as e:
            self._unavailable(e)
            return np.zeros(n, bool)
        return present  # answered from the mapped table: no sign the service is back

    def _start_load(self, req: Request, task: StoreTask) -> None:
        if req.n == 0:
            task.seal()
            return
        self.workers.run(task, lambda ctx, sl: self._load(ctx, req, task, sl))

    def _load(self, ctx: WorkerContext, req: Request, task: StoreTask, sl: slice) -> None:
        keys = self.keys(req.ids[sl], req.shard)
        with task.guard() as ok:
            if not ok:
                return
            try:
                st = self.client.batch_get_into_layers(keys, req.addrs[sl], self._sizes)
            except (ServiceUnavailable, KVFabricError) as e:
                self._unavailable(e)
                task.set(sl, BlockStatus.MISSING if isinstance(e, ServiceUnavailable) else BlockStatus.FAILED)
                return
        out = np.select(
            [st == _OK, st == _NOT_FOUND, st == _CORRUPT],
            [BlockStatus.OK, BlockStatus.MISSING, BlockStatus.CORRUPT],
            BlockStatus.FAILED,
        ).astype(np.int8)
        task.set(sl, out)
        bad = np.flatnonzero(st == _CORRUPT)
        if bad.size:
            self._corrupt_found(int(bad.size), f"pool object '{key_text(keys[int(bad[0])])}'")

    def _start_dump(self, req: Request, task: StoreTask) -> None:
        if req.n == 0:
            task.seal()
            return
        self.workers.submit(task, lambda ctx: self._dump(ctx, req, task))
        task.seal()

    def _dump(self, ctx: WorkerContext, req: Request, task: StoreTask) -> None:
        if not dump_may_start(req.after, task, ctx.stream):
            return
        for start in range(0, req.n, self.config.chunk):
            sl = slice(start, min(start + self.config.chunk, req.n))
            keys = self.keys(req.ids[sl], req.shard)
            with task.guard() as ok:
                if not ok:
                    return
                try:
                    st = self.client.batch_put_from_layers(keys, req.addrs[sl], self._sizes)
                except (ServiceUnavailable, KVFabricError) as e:
                    self._unavailable(e)
                    task.set(sl, BlockStatus.FAILED)
                    continue
            self._warned = False  # the service answered (alloc, commit): warn again if it goes
            good = (st == _OK) | (st == _EXISTS)
            task.set(sl, np.where(good, BlockStatus.OK, BlockStatus.FAILED).astype(np.int8))

    def set_verify(self, verify: Verify | str | bool) -> None:
        """The pool client's read check (see ``TaskStore.set_verify``)."""
        super().set_verify(verify)
        self.client.verify = self.verify

    def _release(self) -> None:
        self.client.close()
        if self._embedded is not None:
            self._embedded.close()
