"""``posix``: one file per block on POSIX file systems (local disks, NFS, Lustre, tmpfs).

Files and atomic writes: see ``posix_files.py``; capacity and GC: see ``posix_gc.py``.

Data path: the caller's addresses may be device memory, so a load reads each file into
a pinned host *bounce* area owned by the worker thread and then moves every piece of the
chunk into place with one ``batch_copy`` on the thread's stream; a dump does the reverse
(one ``batch_copy`` into the bounce area after ``after``, then the file writes). When
every shard of a call is one contiguous run of host memory (a cache slot, a pinned host
buffer), files are read into and written from that memory directly, with no bounce copy.

* ``lookup`` is an existence check of the final names (a file exists only once complete).
* Loads refresh the file's mtime (``posix.touch``): mtime is the hotness clock of GC.
* ``posix.direct`` opens files with ``O_DIRECT`` when the shard size is a multiple of
  4096 and the file system accepts it (probed at start; tmpfs does not), for reads
  into and one-shard writes from the bounce area.
* ENOSPC and every other I/O error make that block ``FAILED``; ENOSPC also wakes GC.
* Integrity (a checksum trailer per file, verified loads, corrupt files removed): see
  ``posix_integrity.py``.
* Start-up: every directory must take a probe write (``DirectoryUnusable`` if not).
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from kvfabric.errors import KVFabricError
from kvfabric.platform.base import Platform
from kvfabric.platform.checksum import Verify, digest_range, digest_views
from kvfabric.platform.types import Medium
from kvfabric.settings import Size, setting
from kvfabric.ucm_layer.store.base import BlockStatus, StoreLayout, TaskKind
from kvfabric.ucm_layer.store.common import Request, TaskStore
from kvfabric.ucm_layer.store.config import StoreConfig, as_paths
from kvfabric.ucm_layer.store.host_views import host_view
from kvfabric.ucm_layer.store.posix_files import (
    ALIGN,
    BlockFiles,
    FileIO,
    PartWriter,
    probe_direct,
    trailer_bytes,
    write_single,
)
from kvfabric.ucm_layer.store.posix_gc import Collector
from kvfabric.ucm_layer.store.posix_integrity import Integrity
from kvfabric.ucm_layer.store.task import StoreTask
from kvfabric.ucm_layer.store.workers import WorkerContext, Workers, copy_pieces, dump_may_start, slot_pieces

log = logging.getLogger("kvfabric.store.posix")

OK, MISSING, FAILED, CORRUPT = BlockStatus.OK, BlockStatus.MISSING, BlockStatus.FAILED, BlockStatus.CORRUPT


@dataclass(frozen=True)
class PosixConfig(StoreConfig):
    """Configuration of the posix store (keys ``posix.*``; see docs/stores.md)."""

    PREFIX: ClassVar[str] = "posix"

    dirs: tuple[str, ...] = setting(
        doc="backend directories (list, or comma-separated); blocks spread by id", parse=as_paths
    )
    capacity: Size = setting(0, doc="bytes of block files kept; 0 = no limit (GC removes the coldest)")
    gc_high: float = setting(0.95, doc="GC starts above this fraction of capacity", lo=0.01, hi=1.0)
    gc_low: float = setting(0.85, doc="GC removes the coldest blocks down to this fraction", lo=0.0, hi=1.0)
    gc_interval: float = setting(30.0, doc="seconds between usage scans (when capacity is set)", lo=0.01)
    tmp_ttl: float = setting(3600.0, doc="seconds after which abandoned temporary files go", lo=0.0)
    direct: bool = setting(False, doc="O_DIRECT when the shard size is a multiple of 4096")
    fsync: bool = setting(False, doc="fsync each file before it becomes visible (power-loss safety)")
    touch: bool = setting(True, doc="loads refresh the file's mtime (the GC hotness clock)")
    io_threads: int = setting(4, doc="worker threads doing file I/O", lo=1, hi=256)
    chunk: Size = setting(16 << 20, doc="bytes of blocks one worker moves per batched copy")
    verify: Verify = setting(Verify.ON, doc="loads check each shard's checksum (on / off)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.gc_low >= self.gc_high:
            raise ValueError(f"posix.gc_low ({self.gc_low}) must be below posix.gc_high ({self.gc_high})")


class PosixStore(TaskStore):
    """The posix store (see module docstring)."""

    name = "posix"

    def __init__(
        self,
        config: PosixConfig,
        *,
        platform: Platform,
        layout: StoreLayout,
        io: FileIO | None = None,
        background_gc: bool = True,
    ) -> None:
        super().__init__(platform, layout)
        self.config = config
        self.io = io or FileIO()
        self.files = BlockFiles(config.dirs)
        self.stride = layout.shard_bytes
        self.data_bytes = layout.num_shards * self.stride
        self.trailer_bytes = trailer_bytes(layout.num_shards, self.stride)
        self.file_bytes = self.data_bytes + self.trailer_bytes
        self.verify = config.verify
        self.integrity = Integrity(
            lambda path: self.io.unlink(path),  # the store's io (tests swap it)
            lambda: self.verify is Verify.ON,
            self.stride,
            self.trailer_bytes,
            self._warn,
            self._corrupt_found,
        )
        self.direct = bool(config.direct and self.stride % ALIGN == 0 and probe_direct(self.files.dirs))
        # a bounce slot: the shard, then room for the trailer (aligned when the shard is)
        self.slot_bytes = -(-(self.stride + self.trailer_bytes) // ALIGN) * ALIGN
        self.chunk_blocks = max(1, min(256, config.chunk // self.slot_bytes))
        self._offsets, self._sizes = layout.offsets, layout.sizes
        self.gc = Collector(
            config.dirs,
            config.capacity,
            config.gc_high,
            config.gc_low,
            config.gc_interval,
            config.tmp_ttl,
            background=background_gc,
        )
        try:
            self.workers = Workers(
                platform,
                config.io_threads,
                "kvfabric-posix",
                scratch=lambda i: platform.alloc(self.chunk_blocks * self.slot_bytes, Medium.DRAM),
                release=platform.free,
            )
        except BaseException:
            self.gc.close()
            raise
        self._warned: set[str] = set()

    @classmethod
    def from_config(cls, config: Mapping[str, Any], **kwargs: Any) -> PosixStore:
        return cls(PosixConfig.from_mapping(config), **kwargs)

    def _chunk_blocks(self) -> int:
        return self.chunk_blocks

    def _warn(self, kind: str, msg: str, *args: object) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning(msg, *args)

    # ------------------------------------------------------------------ lookups
    def lookup(self, ids: np.ndarray) -> np.ndarray:
        arr = self._ids(ids)
        return self.files.exists(self.files.paths(arr))

    def lookup_prefix(self, ids: np.ndarray) -> int:
        """Existence checks in order, stopping at the first missing block."""
        paths = self.files.paths(self._ids(ids))
        for i, path in enumerate(paths):
            if not os.access(path, os.F_OK):
                return i
        return len(paths)

    def prefetch(self, ids: np.ndarray) -> None:
        """Ask the kernel to read present blocks ahead (``posix_fadvise(WILLNEED)``)."""
        paths = self.files.paths(self._ids(ids))
        if not paths or not hasattr(os, "posix_fadvise"):
            return
        task = StoreTask(self, TaskKind.LOAD, 1)

        def job(ctx: WorkerContext) -> None:
            for p in paths:
                try:
                    fd = os.open(p, os.O_RDONLY)
                except OSError:
                    continue
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                finally:
                    os.close(fd)
            task.set(0, OK)

        self.workers.submit(task, job)
        task.seal()

    # ------------------------------------------------------------------ load
    def _start_load(self, req: Request, task: StoreTask) -> None:
        host = req.host_contiguous(self.layout)
        self.workers.run(task, lambda ctx, sl: self._load_chunk(ctx, sl, task, req, host))

    def _scatter_ok(self, req: Request) -> bool:
        """Every destination piece is host memory (DRAM): read straight into the pieces.
        Device memory (HBM, on the sim platform too) takes the bounce buffer and one
        batched platform copy, as it must on a real device."""
        return bool(req.n) and not self.direct and not req.media.any()

    def _read(
        self, path: str, views: list[memoryview], offset: int, direct: bool, trailer: memoryview | None
    ) -> tuple[BlockStatus, tuple[int, int]]:
        """Shard bytes of ``path`` at ``offset`` into ``views`` and, unless ``trailer`` is None
        (verify off), the file's trailer into ``trailer`` (``trailer_bytes``, aligned for
        O_DIRECT; read by the same ``preadv`` when it follows the shard). Returns the status
        and the file's (device, inode), for ``Integrity.drop``. A file of the wrong size is dropped
        here (``CORRUPT``); checking the digest is the caller's."""
        try:
            fd = self.io.open_read(path, direct)
        except FileNotFoundError:
            return MISSING, (0, 0)
        except OSError as e:
            self._warn("open", "posix store: cannot open %s: %s", path, e)
            return FAILED, (0, 0)
        try:
            st = os.fstat(fd)
            ident = (st.st_dev, st.st_ino)
            if st.st_size != self.file_bytes:
                return self.integrity.drop(
                    path, ident, f"{path} has {st.st_size} B, expected {self.file_bytes}"
                ), ident
            if trailer is not None and self.layout.num_shards == 1:
                self.io.read_scatter(fd, [*views, trailer], offset)
            else:
                if len(views) == 1:
                    self.io.read_into(fd, views[0], offset)
                else:
                    self.io.read_scatter(fd, views, offset)
                if trailer is not None:
                    self.io.read_into(fd, trailer, self.data_bytes)
            if self.config.touch:
                self.io.touch(fd)
            return OK, ident
        except OSError as e:
            self._warn("read", "posix store: reading %s failed: %s", path, e)
            return FAILED, (0, 0)
        finally:
            self.io.close(fd)

    def _load_chunk(self, ctx: WorkerContext, sl: slice, task: StoreTask, req: Request, host: bool) -> None:
        paths = self.files.paths(req.ids[sl])
        offset = req.shard * self.stride
        sizes = self._sizes.tolist()
        if host or self._scatter_ok(req):  # straight into the caller's host memory, no bounce
            trailer = self.integrity.buffer()  # one per chunk: read and checked block by block
            for j, path in enumerate(paths):
                with task.guard() as ok:
                    if not ok:
                        return
                    row = req.addrs[sl.start + j].tolist()
                    # one contiguous shard, or host pieces (one preadv per block, no extra copy)
                    ranges = [(int(row[0]), self.stride)] if host else list(zip(row, sizes))
                    views = [host_view(a, n) for a, n in ranges]
                    st, ident = self._read(path, views, offset, False, trailer)
                    got = digest_views(views) if st is OK and trailer is not None else 0
                    st = self.integrity.checked(st, got, trailer, req.shard, path, ident)
                    task.set(sl.start + j, st)
                    if st is OK and got:
                        task.record_digest(sl.start + j, got)
            return
        bounce = ctx.scratch.numpy()
        verify = self.integrity.on
        got = np.zeros(len(paths), bool)
        idents: list[tuple[int, int]] = [(0, 0)] * len(paths)
        for j, path in enumerate(paths):
            if task.cancelled is not None:
                return
            base = j * self.slot_bytes
            view = memoryview(bounce[base : base + self.stride])
            trailer = memoryview(bounce[base + self.stride : base + self.stride + self.trailer_bytes])
            st, idents[j] = self._read(path, [view], offset, self.direct, trailer if verify else None)
            if st is OK:
                got[j] = True
            else:
                task.set(sl.start + j, st)
        idx = np.flatnonzero(got)
        if not idx.size:
            return
        bases = ctx.scratch.ptr + idx.astype(np.uint64) * self.slot_bytes
        src = slot_pieces(bases, self._offsets)
        with task.guard() as ok:
            if not ok:
                return
            try:  # hashed on the host while the copy to the caller runs (a DMA on a device)
                digests = (
                    copy_pieces(
                        self.platform,
                        ctx.stream,
                        req.addrs[sl][idx],
                        src,
                        self._piece_sizes(idx.size),
                        lambda: self.integrity.slot_digests(bases),
                    )
                    or []
                )
            except KVFabricError as e:
                self._warn("copy", "posix store: copy into the caller's buffers failed: %s", e)
                task.set(sl.start + idx, FAILED)
                return
            for q, j in enumerate(idx.tolist()):
                if verify:
                    base = j * self.slot_bytes + self.stride
                    trailer = memoryview(bounce[base : base + self.trailer_bytes])
                    st = self.integrity.checked(OK, digests[q], trailer, req.shard, paths[j], idents[j])
                else:
                    st = OK
                task.set(sl.start + j, st)

    def _piece_sizes(self, k: int) -> np.ndarray:
        return np.broadcast_to(self._sizes, (k, self.layout.pieces))

    # ------------------------------------------------------------------ dump
    def _start_dump(self, req: Request, task: StoreTask) -> None:
        host = req.host_contiguous(self.layout)
        self.workers.run(task, lambda ctx, sl: self._dump_chunk(ctx, sl, task, req, host))

    def _dump_chunk(self, ctx: WorkerContext, sl: slice, task: StoreTask, req: Request, host: bool) -> None:
        if not dump_may_start(req.after, task, ctx.stream, sl):
            return
        paths = self.files.paths(req.ids[sl])
        present = self.files.exists(paths)
        task.set(sl.start + np.flatnonzero(present), OK)
        todo = np.flatnonzero(~present)
        if not todo.size:
            return
        if host:  # straight from the caller's host memory, under the guard throughout
            for j in todo.tolist():
                with task.guard() as ok:
                    if not ok:
                        return
                    addr = int(req.addrs[sl.start + j, 0])
                    digest = digest_range(addr, self.stride)
                    self._write(paths[j], host_view(addr, self.stride), req.shard, task, sl.start + j, digest)
            return
        dst = slot_pieces(
            ctx.scratch.ptr + np.arange(todo.size, dtype=np.uint64) * self.slot_bytes, self._offsets
        )
        with task.guard() as ok:
            if not ok:
                return
            try:
                copy_pieces(self.platform, ctx.stream, dst, req.addrs[sl][todo], self._piece_sizes(todo.size))
            except KVFabricError as e:
                self._warn("copy", "posix store: copy out of the caller's buffers failed: %s", e)
                task.set(sl.start + todo, FAILED)
                return
        bounce = ctx.scratch.numpy()
        for q, j in enumerate(todo.tolist()):
            if task.cancelled is not None:
                return
            base = q * self.slot_bytes
            digest = digest_range(ctx.scratch.ptr + base, self.stride)
            if self.layout.num_shards == 1:  # data and trailer in one (O_DIRECT-able) write
                whole = self.integrity.seal(bounce, base, digest)
                self._write(paths[j], whole, req.shard, task, sl.start + j, digest, self.direct, True)
            else:
                view = memoryview(bounce[base : base + self.stride])
                self._write(paths[j], view, req.shard, task, sl.start + j, digest)

    def _write(
        self,
        final: str,
        view: memoryview,
        shard: int,
        task: StoreTask,
        i: int,
        digest: int,
        direct: bool = False,
        sealed: bool = False,
    ) -> None:
        """Write one shard (``view``; ``sealed``: it already ends with its trailer) and make
        the block visible when complete."""
        try:
            if self.layout.num_shards == 1:
                trailer = None if sealed else self.integrity.trailer(digest)
                tmp = write_single(self.io, final, view, direct, self.config.fsync, trailer)
                with task.guard() as ok:
                    if ok:
                        self.io.rename(tmp, final)
                        task.set(i, OK)
                        self.gc.added(self.file_bytes)
                        return
                self.io.unlink(tmp)
                return
            w = PartWriter(self.io, final, self.layout.num_shards, self.stride, self.config.fsync)
            try:
                if not w.write(shard, view, digest):
                    task.set(i, OK)  # the block got complete meanwhile
                    return
                with task.guard() as ok:
                    if ok:
                        if w.arrive(shard):
                            self.gc.added(self.file_bytes)
                        task.set(i, OK)
            finally:
                w.close()
        except OSError as e:
            if e.errno == errno.ENOSPC:
                self.gc.out_of_space()
                self._warn("enospc", "posix store: out of space writing %s", final)
            else:
                self._warn("write", "posix store: writing %s failed: %s", final, e)
            task.set(i, FAILED)

    # ------------------------------------------------------------------ maintenance
    def collect(self) -> Any:
        """Run one maintenance scan now (usage, GC, stale temporaries); return its report."""
        return self.gc.collect()

    def stats(self) -> dict[str, int]:
        out = super().stats()
        out["usage_bytes"] = int(self.gc.usage)
        return out

    def _release(self) -> None:
        self.gc.close()
