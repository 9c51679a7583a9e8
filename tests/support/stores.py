"""Store builders for the store conformance suite, importable in spawned children too.

``STORE_SPECS`` lists every store and pipeline the suite runs on. Pool specs reach a
pool daemon running inside the test process (``PoolDaemon`` threads) on a socket under the
test's directory, started on first use with the test's platform; spawned children connect
to the same socket. ``stop_pool_daemons()`` ends them (the store fixtures call it).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from kvfabric.platform.base import Platform
from kvfabric.platform.types import Medium
from kvfabric.ucm_layer.store.base import BlockStatus, Store, StoreLayout
from kvfabric.ucm_layer.store.registry import create

STORE_SPECS = ["posix", "cache", "cache|posix", "pool", "cache|pool"]
#: lowest tiers whose contents outlive the writing process (the killed-writer test applies)
PERSISTENT = {"posix", "pool"}


@pytest.fixture(params=STORE_SPECS)
def store_spec(request: pytest.FixtureRequest) -> str:
    """Every store and pipeline, for a contract module that imports this fixture."""
    return request.param


LAYOUT = StoreLayout((4096, 1000, 77))


def config_for(spec: str, root: str | os.PathLike[str], layout: StoreLayout, **overrides: object) -> dict:
    tiers = spec.split("|")
    cfg: dict[str, object] = {"store": spec}
    if "posix" in tiers:
        cfg["posix.dirs"] = [str(Path(root) / "a"), str(Path(root) / "b")]
        cfg["posix.io_threads"] = 2
        cfg["posix.chunk"] = 4 * layout.shard_bytes
    if "cache" in tiers:
        cfg["cache.capacity"] = 256 * (layout.shard_bytes + 64)
    if "pool" in tiers:
        cfg["pool.socket"] = str(Path(root) / "pool.sock")
        cfg["pool.timeout"] = 5.0
    if len(tiers) > 1:
        cfg["pipeline.workers"] = 2
    cfg.update(overrides)
    return cfg


def build_store(
    spec: str,
    root: str | os.PathLike[str],
    platform: Platform,
    layout: StoreLayout = LAYOUT,
    **overrides: object,
) -> Store:
    cfg = config_for(spec, root, layout, **overrides)
    if "pool.socket" in cfg:
        ensure_pool_daemon(str(cfg["pool.socket"]), platform)
    return create(config=cfg, platform=platform, layout=layout)


_daemons: dict[str, object] = {}


def ensure_pool_daemon(socket: str, platform: Platform) -> None:
    """A pool daemon (threads of this process) on ``socket``, unless one answers there."""
    from kvfabric.errors import ServiceUnavailable
    from kvfabric.pool import protocol
    from kvfabric.pool.client.rpc import SocketTransport
    from kvfabric.pool.config import PoolConfig
    from kvfabric.pool.service.daemon import PoolDaemon

    if socket in _daemons:
        return
    probe = SocketTransport(socket, timeout=0.5)
    try:
        probe.call(protocol.Info())
        return  # another process's (the test parent's) daemon
    except ServiceUnavailable:
        pass
    finally:
        probe.close()
    name = f"t{abs(hash(socket)) % 10**8}"
    d = PoolDaemon(
        PoolConfig(
            name=name, dram=64 << 20, socket=socket, max_objects=8192, write_lease_s=2.0, pretouch=False
        ),
        platform,
    )
    d.start()
    _daemons[socket] = d


def stop_pool_daemons() -> None:
    while _daemons:
        _, d = _daemons.popitem()
        d.stop()  # type: ignore[attr-defined]


def lowest(spec: str) -> str:
    return spec.split("|")[-1]


def tier(store: Store, name: str) -> Store | None:
    """The store called ``name`` inside ``store`` (itself, or a pipeline's lower tier)."""
    for s in (store, getattr(store, "lower", None)):
        if s is not None and s.name == name:
            return s
    return None


def block_bytes(ids: np.ndarray, nbytes: int, salt: int = 0) -> np.ndarray:
    """``(n, nbytes)`` contents derived from each id, so any block can be verified alone."""
    out = np.empty((len(ids), nbytes), np.uint8)
    for i, row in enumerate(ids):
        seed = int.from_bytes(bytes(row[:8]), "little") ^ salt
        out[i] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    return out


def random_ids(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, 16), dtype=np.uint8)


class Blocks:
    """``n`` blocks laid out in one platform buffer (device memory by default), with gaps,
    pieces in reverse order (so the address matrix is not a trivial stride) and a sentinel
    byte everywhere else. Bytes go in and out through a host mirror and platform copies, so
    this works on every platform."""

    SENTINEL = 0xA5

    def __init__(
        self,
        platform: Platform,
        layout: StoreLayout,
        n: int,
        medium: Medium = Medium.HBM,
        contiguous: bool = False,
    ) -> None:
        self.platform, self.layout, self.n = platform, layout, n
        shard = layout.shard_bytes
        self.stride = shard if contiguous else shard + 128
        size = max(1, n) * self.stride + 64
        self.buf = platform.alloc(size, medium)
        self.host = platform.alloc(size, Medium.DRAM)
        offs = layout.offsets.astype(np.int64)
        if not contiguous:
            offs = (shard - offs - np.asarray(layout.piece_sizes)).astype(np.int64) + 64
        self.addrs = (self.buf.ptr + np.arange(n)[:, None] * self.stride + offs[None, :]).astype(np.uint64)
        self.fill_sentinel()

    def view(self) -> np.ndarray:
        """The buffer's current bytes (a host copy)."""
        self.platform.copy(self.host, self.buf)
        return self.host.numpy()

    def _push(self) -> None:
        self.platform.copy(self.buf, self.host)

    def fill_sentinel(self) -> None:
        self.host.numpy()[:] = self.SENTINEL
        self._push()

    def _spans(self, i: int) -> list[tuple[int, int]]:
        base = self.buf.ptr
        return [(int(a) - base, int(s)) for a, s in zip(self.addrs[i], self.layout.piece_sizes)]

    def write(self, data: np.ndarray) -> None:
        """Scatter ``(n, shard_bytes)`` contents into the pieces."""
        v = self.view()
        for i in range(self.n):
            pos = 0
            for off, size in self._spans(i):
                v[off : off + size] = data[i, pos : pos + size]
                pos += size
        self._push()

    def read(self) -> np.ndarray:
        """Gather the pieces back into ``(n, shard_bytes)``."""
        v = self.view()
        out = np.empty((self.n, self.layout.shard_bytes), np.uint8)
        for i in range(self.n):
            pos = 0
            for off, size in self._spans(i):
                out[i, pos : pos + size] = v[off : off + size]
                pos += size
        return out

    def untouched(self, i: int) -> bool:
        v = self.view()
        return all((v[off : off + size] == self.SENTINEL).all() for off, size in self._spans(i))

    def free(self) -> None:
        self.platform.free(self.buf)
        self.platform.free(self.host)


def dump_blocks(
    store: Store, plat: Platform, ids: np.ndarray, layout: StoreLayout = LAYOUT, salt: int = 0
) -> np.ndarray:
    """Dump ``block_bytes(ids)`` (shard 0) from fresh device blocks, wait, free; the statuses."""
    b = Blocks(plat, layout, len(ids))
    b.write(block_bytes(ids, layout.shard_bytes, salt))
    st = store.wait(store.dump(ids, 0, b.addrs))
    b.free()
    return st


def load_checked(store: Store, plat: Platform, ids: np.ndarray) -> np.ndarray:
    """Load ``ids`` (shard 0) into fresh blocks; every OK block must hold ``block_bytes``."""
    b = Blocks(plat, LAYOUT, len(ids))
    st = store.wait(store.load(ids, 0, b.addrs))
    ok = st == int(BlockStatus.OK)
    assert np.array_equal(b.read()[ok], block_bytes(ids[ok], LAYOUT.shard_bytes))
    b.free()
    return st


# ---------------------------------------------------------------------------- platform faults
