"""``SimPlatform``: the platform contract on host memory, with real bytes and real sharing.

"Device" (HBM) and host (DRAM) buffers are both host memory. Shareable buffers are POSIX
shared-memory segments (see ``platform/shm.py``) that another process maps through
``import_handle``; the others are private anonymous mappings. Copies are real memcpy
(``memmove`` for one piece, the native batched loop for many; both release the GIL;
copies of 4 MiB and more are split across a few threads, see ``copier.py``).
Streams are worker threads. Each copy is also priced by the cost model, and the
``ledger`` keeps wall and simulated time side by side. ``faults`` injects failures.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvfabric.errors import OutOfSpace, TransferFailed
from kvfabric.platform import native, shm
from kvfabric.platform.base import Platform
from kvfabric.platform.buffer import Buffer
from kvfabric.platform.handles import HandleRecord
from kvfabric.platform.hostwrap import host_wrap_info
from kvfabric.platform.hugepages import HugePages
from kvfabric.platform.sim.copier import HostCopier
from kvfabric.platform.sim.cost import DEFAULT_MODEL, CostLedger, CostModel
from kvfabric.platform.sim.faults import CopyFault, FaultInjector
from kvfabric.platform.sim.streams import SimEventState, SimStreamWorker
from kvfabric.platform.stream import Event, Stream
from kvfabric.platform.types import CopyBatch, DeviceInfo, Direction, Medium, PlatformInfo
from kvfabric.settings import coerce_fields, setting

_swept_dirs: set[str] = set()
_sweep_lock = threading.Lock()


@dataclass(frozen=True)
class SimConfig:
    """Configuration of a sim platform.

    ``alloc_cap``: refuse allocations past this many owned bytes (None: no cap; the
    shared-memory directory's free space still applies). ``sweep_on_start``: unlink
    segments left by dead processes when the first platform of a process starts.
    ``copy_threads``: threads a large host copy is split across (None: ``KVFABRIC_COPY_THREADS``,
    else the usable cores, at most 4; see ``copier.py``). ``hugepages``: the pages of shareable
    buffers and named segments (``auto``, ``on``, ``off``, ``thp``, ``hugetlb``; None:
    ``KVFABRIC_HUGEPAGES``, default auto; see ``platform/hugepages.py``).
    """

    cost_model: CostModel = field(default_factory=lambda: CostModel.preset(DEFAULT_MODEL))
    alloc_cap: int | None = None
    shm_dir: str | None = None
    sweep_on_start: bool = True
    copy_threads: int | None = None
    hugepages: HugePages | None = setting(
        None, doc="pages of shareable buffers: auto, on, off, thp, hugetlb (None: KVFABRIC_HUGEPAGES)"
    )

    def __post_init__(self) -> None:
        coerce_fields(self, lambda key: f"sim config {key}")
        if self.copy_threads is not None and self.copy_threads < 1:
            raise ValueError(f"SimConfig.copy_threads must be >= 1 or None, got {self.copy_threads}")
        if self.alloc_cap is not None and self.alloc_cap < 0:
            raise ValueError(f"SimConfig.alloc_cap must be >= 0 or None, got {self.alloc_cap}")
        if self.shm_dir is not None and not os.path.isdir(self.shm_dir):
            raise ValueError(f"SimConfig.shm_dir {self.shm_dir!r} is not a directory")


@dataclass
class _Private:
    mm: mmap.mmap
    array: np.ndarray


class SimPlatform(Platform):
    """The simulation backend (see module docstring)."""

    name = "sim"

    def __init__(self, device: int = 0, config: SimConfig | None = None) -> None:
        super().__init__(device)
        self.config = config or SimConfig()
        self.ledger = CostLedger()
        self.faults = FaultInjector(self.config.alloc_cap)
        self._owned_bytes = 0
        self._bytes_lock = threading.Lock()
        self._native = native.get()
        self._copier = HostCopier(self._native, self.config.copy_threads)
        self.swept: list[str] = []
        d = self.config.shm_dir or shm.shm_dir()
        if self.config.sweep_on_start:
            with _sweep_lock:
                if d not in _swept_dirs:
                    _swept_dirs.add(d)
                    self.swept = shm.sweep(d)

    # ------------------------------------------------------------------ memory
    def _reserve(self, nbytes: int, medium: Medium) -> None:
        with self._bytes_lock:
            cap = self.faults.alloc_cap
            if cap is not None and self._owned_bytes + nbytes > cap:
                raise OutOfSpace(
                    f"alloc of {nbytes} B {medium.value} on sim:{self.device} refused: "
                    f"{self._owned_bytes} B of a {cap} B cap already in use"
                )
            self._owned_bytes += nbytes

    def _release_bytes(self, nbytes: int) -> None:
        with self._bytes_lock:
            self._owned_bytes -= nbytes

    @property
    def copy_threads(self) -> int:
        """Threads a host copy of ``copier.PARALLEL_BYTES`` or more is split across."""
        return self._copier.threads

    @property
    def hugepages(self) -> HugePages:
        """The ``hugepages`` mode the next shareable allocation uses (``shm.effective_hugepages``)."""
        return shm.effective_hugepages(self.config.hugepages)

    @property
    def owned_bytes(self) -> int:
        return self._owned_bytes

    def _alloc(self, nbytes: int, medium: Medium, shareable: bool) -> tuple[int, Any]:
        self._reserve(nbytes, medium)
        try:
            if shareable:
                seg = shm.create(nbytes, self.config.shm_dir, self.hugepages)
                return seg.ptr, seg
            mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            shm.advise_huge(mm, nbytes)
            arr = np.frombuffer(mm, dtype=np.uint8)
            return int(arr.ctypes.data), _Private(mm, arr)
        except BaseException:
            self._release_bytes(nbytes)
            raise

    def _alloc_named(self, name: str, nbytes: int) -> tuple[int, Any, bool]:
        self._reserve(nbytes, Medium.DRAM)
        try:
            seg, created = shm.open_named(name, nbytes, self.config.shm_dir, self.hugepages)
        except BaseException:
            self._release_bytes(nbytes)
            raise
        return seg.ptr, seg, created

    def _unlink_named(self, name: str) -> bool:
        return shm.unlink_named(name, self.config.shm_dir)

    def _free(self, buf: Buffer) -> None:
        impl = buf.impl
        buf.impl = None
        self._release_bytes(buf.nbytes)
        if isinstance(impl, shm.Segment):
            impl.close()
            if impl.owner:  # named (persistent) segments are only unlinked by name
                impl.unlink()
        elif isinstance(impl, _Private):
            impl.array = None  # type: ignore[assignment]
            try:
                impl.mm.close()
            except BufferError:
                pass  # a user view still aliases it; it is released with that view

    def host_addressable(self, medium: Medium) -> bool:
        return True  # sim "device" memory is host memory

    def _register_host(self, ptr: int, nbytes: int) -> Any:
        return None  # host memory needs no pinning for the sim "device"

    def _unregister_host(self, buf: Buffer) -> None:
        pass

    def _wrap_info(self, obj: Any, medium: Medium | None) -> tuple[int, int, Medium]:
        ptr, n = host_wrap_info(obj)
        return ptr, n, medium or Medium.DRAM

    def _numpy_view(self, buf: Buffer) -> np.ndarray:
        impl = buf.impl
        if isinstance(impl, (shm.Segment, _Private)) and impl.array is not None:
            return impl.array
        raw = (ctypes.c_uint8 * buf.nbytes).from_address(buf.ptr)
        return np.frombuffer(raw, dtype=np.uint8)

    # ------------------------------------------------------------------ IPC
    def _export(self, buf: Buffer) -> bytes:
        seg = buf.impl
        if not isinstance(seg, shm.Segment):
            raise ValueError(f"{buf!r} is not backed by shared memory")
        return seg.ref.encode()

    def _import(self, rec: HandleRecord) -> tuple[int, Any]:
        seg = shm.attach(rec.payload.decode(), rec.nbytes, self.config.shm_dir)
        return seg.ptr, seg

    def _close_import(self, buf: Buffer) -> None:
        seg, buf.impl = buf.impl, None
        if isinstance(seg, shm.Segment):
            seg.close()

    # ------------------------------------------------------------------ copies
    def _run_copy(
        self, dst: int, src: int, nbytes: int, direction: Direction, fault: CopyFault | None
    ) -> None:
        if fault is not None:
            if fault.torn and nbytes > 1:
                ctypes.memmove(dst, src, nbytes // 2)
            raise TransferFailed(
                f"injected fault: copy {direction.name} of {nbytes} B {src:#x} -> {dst:#x} "
                f"failed on sim:{self.device}"
            )
        t0 = time.perf_counter()
        self._copier.copy_one(dst, src, nbytes)
        wall = time.perf_counter() - t0
        self.ledger.add(direction, nbytes, wall, self.config.cost_model.copy_seconds(direction, nbytes))

    def _copy(self, dst: int, src: int, nbytes: int, direction: Direction, stream: Stream | None) -> None:
        fault = self.faults.next_copy()
        if stream is None:
            self._run_copy(dst, src, nbytes, direction, fault)
        else:
            stream.handle.submit(lambda: self._run_copy(dst, src, nbytes, direction, fault))

    def _run_batch(self, batch: CopyBatch, directions: np.ndarray, fault: CopyFault | None) -> None:
        if fault is not None:
            k = len(batch) // 2 if fault.torn else 0
            if k:
                self._native.memcpy_batch(batch.dst[:k], batch.src[:k], batch.nbytes[:k])
            raise TransferFailed(
                f"injected fault: batch copy of {len(batch)} pieces ({batch.total_bytes} B) "
                f"failed on sim:{self.device} after {k} pieces"
            )
        total = batch.total_bytes
        t0 = time.perf_counter()
        self._copier.copy_batch(batch.dst, batch.src, batch.nbytes, total)
        wall = time.perf_counter() - t0
        first = int(directions[0])
        if len(batch) == 1 or (directions == first).all():
            per_dir = {Direction(first): total}
        else:
            per_dir = {
                Direction(int(d)): int(batch.nbytes[directions == d].sum()) for d in np.unique(directions)
            }
        sim = self.config.cost_model.batch_seconds(per_dir, len(batch))
        for d, n in per_dir.items():  # split wall and simulated time by bytes
            share = n / total
            self.ledger.add(d, n, wall * share, sim * share)

    def _batch_copy(self, batch: CopyBatch, directions: np.ndarray, stream: Stream | None) -> None:
        fault = self.faults.next_copy()
        if stream is None:
            self._run_batch(batch, directions, fault)
        else:
            stream.handle.submit(lambda: self._run_batch(batch, directions, fault))

    # ------------------------------------------------------------------ streams, events
    def _stream_create(self) -> SimStreamWorker:
        return SimStreamWorker(f"kvfabric-sim{self.device}-stream")

    def _stream_destroy(self, stream: Stream) -> None:
        stream.handle.close()

    def _stream_synchronize(self, stream: Stream, timeout: float | None) -> None:
        err = stream.handle.synchronize(timeout)
        if err is not None:
            raise TransferFailed(f"a copy on {stream!r} failed: {err}") from err

    def _stream_query(self, stream: Stream) -> bool:
        return stream.handle.query()

    def _stream_wait_event(self, stream: Stream, event: Event) -> None:
        stream.handle.wait_event(event.handle)

    def stall(self, stream: Stream, seconds: float) -> None:
        """Fault injection: queue ``seconds`` of dead time on ``stream``."""
        self._check_stream(stream)
        if seconds < 0:
            raise ValueError(f"stall needs seconds >= 0, got {seconds}")
        stream.handle.stall(seconds)

    def _event_create(self) -> SimEventState:
        return SimEventState()

    def _event_record(self, event: Event, stream: Stream) -> None:
        stream.handle.record(event.handle)

    def _event_query(self, event: Event) -> bool:
        return event.handle.query()

    def _event_synchronize(self, event: Event, timeout: float | None) -> None:
        err = event.handle.wait(None, timeout)
        if err is not None:
            raise TransferFailed(f"a copy before {event!r} failed: {err}") from err

    # ------------------------------------------------------------------ info
    def _info(self) -> PlatformInfo:
        cap = self.faults.alloc_cap
        free = None if cap is None else max(cap - self._owned_bytes, 0)
        dev = DeviceInfo(self.device, f"sim device ({self.config.cost_model.name} cost model)", cap, free)
        return PlatformInfo(
            "sim",
            f"host memory, {type(self._native).__name__} copies",
            (dev,),
            supports_ipc=True,
            supports_batch_copy=True,
        )
