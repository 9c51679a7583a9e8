"""Store builders for the store conformance suite, importable in spawned children too.

``STORE_SPECS`` lists every store and pipeline the suite runs on. Pool specs reach a
pool daemon running inside the test process (``PoolDaemon`` threads) on a socket under the
test's directory, started on first use with the test's platform; spawned children connect
to the same socket. ``stop_pool_daemons()`` ends them (the store fixtures call it).
"""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import numpy as np

from kvfabric.platform.base import Platform
from kvfabric.platform.types import Medium
from kvfabric.ucm_layer.store.base import BlockStatus, Store, StoreLayout
from kvfabric.ucm_layer.store.posix_files import FileIO
from kvfabric.ucm_layer.store.registry import create

STORE_SPECS = ["posix", "cache", "cache|posix", "pool", "cache|pool"]
#: lowest tiers whose contents outlive the writing process (the killed-writer test applies)
PERSISTENT = {"posix", "pool"}

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
    from kvfabric.pool.config import PoolConfig
    from kvfabric.pool.daemon import PoolDaemon
    from kvfabric.pool.rpc import SocketTransport

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


def stall_pool_copies(store: Store, marker: str) -> None:
    """Make the pool store's next copy into the pool write half its pieces, drop
    ``marker`` and hang (the test then kills the process mid-dump)."""
    dp = store.client.dp  # type: ignore[attr-defined]
    real = dp.write

    def half_then_hang(gvas, srcs, sizes):
        k = max(1, len(gvas) // 2)
        real(gvas[:k], srcs[:k], sizes[:k])
        Path(marker).write_text("stalled")
        while True:
            time.sleep(1)

    dp.write = half_then_hang


def posix_tier(store: Store) -> Store | None:
    """The posix store inside ``store`` (itself, or a pipeline's lower tier), if any."""
    for s in (store, getattr(store, "lower", None)):
        if s is not None and s.name == "posix":
            return s
    return None


# ---------------------------------------------------------------------------- planted corruption
FLIP_AT = 100  # the byte of a shard that ``plant_flip`` inverts (inside the first piece)


def plant_flip(store: Store, block_id: np.ndarray, shard: int = 0, at: int = FLIP_AT) -> None:
    """Invert one byte of shard ``shard`` of ``block_id`` where ``store`` (one tier, not a
    pipeline) keeps it, leaving every size as it was: in the block file on disk (posix), in
    the slot's memory (cache), in the pool's window (pool)."""
    import ctypes

    from kvfabric.ucm_layer.store.cache_index import keys_of

    ids = np.ascontiguousarray(block_id.reshape(1, 16))
    if store.name == "posix":
        path = store.files.paths(ids)[0]  # type: ignore[attr-defined]
        with open(path, "r+b") as f:
            f.seek(shard * store.layout.shard_bytes + at)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0xFF]))
        return
    if store.name == "cache":
        slot = store.table.index[int(keys_of(ids, shard)[0])]  # type: ignore[attr-defined]
        ptr = store.buffer.ptr + slot * store.slot_bytes + at  # type: ignore[attr-defined]
    elif store.name == "pool":
        client = store.client  # type: ignore[attr-defined]
        key = store.keys(ids, shard)[0].encode()  # type: ignore[attr-defined]
        i, (_seq, gva, size, _gen, _state, _exp, _csum) = client.table.lookup_raw(key)
        assert i >= 0, f"pool key {key!r} not found"
        local = client.dp.local(gva, size)
        assert local is not None and local[1], "the pool object is not in host memory mapped here"
        ptr = local[0] + at
    else:
        raise ValueError(f"no way to plant corruption in store {store.name!r}")
    byte = ctypes.c_ubyte.from_address(int(ptr))
    byte.value ^= 0xFF


# ---------------------------------------------------------------------------- block data
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
def fail_copies(plat: Platform, count: int = 100000) -> None:
    """Make the next ``count`` copies fail on a platform with fault injection (else skip)."""
    if hasattr(plat, "faults"):
        plat.faults.fail_copy(nth=1, count=count)
    elif hasattr(getattr(plat, "runtime", None), "fail_next_copy"):
        plat.runtime.fail_next_copy(count)
    else:
        import pytest

        pytest.skip(f"{plat!r} has no fault injection")


def clear_faults(plat: Platform) -> None:
    if hasattr(plat, "faults"):
        plat.faults.clear()
    elif hasattr(getattr(plat, "runtime", None), "fail_copies"):
        plat.runtime.fail_copies = 0


def blocked_event(plat: Platform, seconds: float) -> tuple:
    """``(stream, event)``: an event that completes only after ``seconds`` (sim: a stalled
    stream), or only once the stream is synchronized (the fake device runtime, which runs
    queued copies only when waited on). Skips on real hardware."""
    from kvfabric.platform.types import Medium as M

    s = plat.stream()
    if hasattr(plat, "stall"):
        plat.stall(s, seconds)
    elif type(getattr(plat, "runtime", None)).__name__ == "HostRuntime":
        a, b = plat.alloc(4096, M.DRAM), plat.alloc(4096, M.HBM)
        plat.copy(b, a, stream=s)
    else:
        import pytest

        s.close()
        pytest.skip(f"{plat!r} cannot hold an event back")
    ev = plat.event()
    ev.record(s)
    return s, ev


# ---------------------------------------------------------------------------- posix I/O faults
class StallingIO(FileIO):
    """Writes half of a block file, drops a marker file, then stalls (until ``release``).
    Writes of at most ``SMALL`` bytes (checksum trailers, digests, arrival flags) never
    stall and do not count as blocks."""

    SMALL = 64

    def __init__(self, marker: str, after_blocks: int = 0) -> None:
        self.marker, self.after_blocks = marker, after_blocks
        self.release = threading.Event()
        self._writes = 0
        self._lock = threading.Lock()

    def write_from(self, fd: int, view: memoryview, offset: int) -> None:
        if len(view) <= self.SMALL:
            return super().write_from(fd, view, offset)
        with self._lock:
            self._writes += 1
            stall = self._writes > self.after_blocks and len(view) > self.SMALL
        if not stall:
            return super().write_from(fd, view, offset)
        half = len(view) // 2
        super().write_from(fd, view[:half], offset)
        Path(self.marker).touch()
        self.release.wait()
        super().write_from(fd, view[half:], offset + half)


class SlowReadIO(FileIO):
    """Every read (one buffer or scattered) waits until ``release`` is set (then completes
    normally)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Event()

    def read_into(self, fd: int, view: memoryview, offset: int) -> None:
        self.started.set()
        self.release.wait()
        super().read_into(fd, view, offset)

    def read_scatter(self, fd: int, views: list[memoryview], offset: int) -> None:
        self.started.set()
        self.release.wait()
        super().read_scatter(fd, views, offset)


class FullDiskIO(FileIO):
    """A file system that runs out of space after ``budget`` bytes of writes (ENOSPC)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._lock = threading.Lock()

    def write_from(self, fd: int, view: memoryview, offset: int) -> None:
        with self._lock:
            if len(view) > self.budget:
                self.budget = 0
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.budget -= len(view)
        super().write_from(fd, view, offset)


# ---------------------------------------------------------------------------- child process
def child_dump_forever(
    spec: str, root: str, env: dict, seed: int, n: int, stall: bool, platform: str = "sim"
) -> None:
    """Child: dump ``n`` blocks of ``random_ids(n, seed)`` again and again under fresh ids
    derived from a round counter; with ``stall``, the posix tier stalls mid-file after the
    first two blocks and drops ``root/stalled``. Runs until killed."""
    os.environ.update(env)
    from platforms import build

    plat = build(platform)
    store = build_store(spec, root, plat)
    if stall:
        posix = posix_tier(store)
        if posix is not None:
            posix.io = StallingIO(os.path.join(root, "stalled"), after_blocks=2)
        else:
            stall_pool_copies(tier(store, "pool"), os.path.join(root, "stalled"))
    blocks = Blocks(plat, LAYOUT, n)
    for r in range(10**6):
        ids = random_ids(n, seed + r)
        blocks.write(block_bytes(ids, LAYOUT.shard_bytes))
        store.wait(store.dump(ids, 0, blocks.addrs))
        Path(os.path.join(root, "progress")).write_text(str(r))
        time.sleep(0.001)
