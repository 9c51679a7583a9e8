"""``RuntimePlatform``: the platform contract on top of a CUDA-style device runtime.

CUDA and ACL expose the same shape of API (malloc / host alloc / host register /
memcpyAsync with a kind / streams / events / IPC of device memory), so one platform class
serves both; each backend supplies a :class:`DeviceRuntime` that maps those calls onto its
SDK (``cuda/runtime.py`` on CuPy, ``ascend/acl.py`` on ACL through cffi). Tests drive the
same class with a small stateful host-memory runtime, so the logic here is exercised on
machines without either device.

Memory: HBM buffers come from ``runtime.malloc`` (IPC-exportable as allocated); DRAM
buffers are pinned (``host_alloc``), or, when shareable, POSIX shared memory registered
with the runtime so the device can DMA to it and other processes can map it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from kvfabric.errors import TransferFailed
from kvfabric.platform import shm
from kvfabric.platform.base import Platform
from kvfabric.platform.buffer import Buffer
from kvfabric.platform.handles import HandleRecord
from kvfabric.platform.hostwrap import host_wrap_info
from kvfabric.platform.stream import Event, Stream
from kvfabric.platform.types import CopyBatch, DeviceInfo, Direction, Medium, PlatformInfo


class DeviceRuntime(Protocol):
    """The device SDK calls a :class:`RuntimePlatform` needs. Every method raises on failure.

    Stream and event handles are opaque. ``memcpy_async`` kinds are the
    :class:`~kvfabric.platform.types.Direction` values (the same in CUDA and ACL).
    ``memcpy_batch_async`` returns False when the SDK has no batched copy for these
    pieces (the platform then submits them one by one).
    """

    name: str

    def device_count(self) -> int: ...
    def set_device(self, index: int) -> None: ...
    def device_name(self, index: int) -> str: ...
    def mem_info(self) -> tuple[int, int]: ...
    def malloc(self, nbytes: int) -> int: ...
    def free(self, ptr: int) -> None: ...
    def host_alloc(self, nbytes: int) -> int: ...
    def host_free(self, ptr: int) -> None: ...
    def host_register(self, ptr: int, nbytes: int) -> None: ...
    def host_unregister(self, ptr: int) -> None: ...
    def memcpy_async(self, dst: int, src: int, nbytes: int, kind: int, stream: Any) -> None: ...
    def memcpy_batch_async(
        self, dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray, kinds: np.ndarray, stream: Any
    ) -> bool: ...
    def stream_create(self) -> Any: ...
    def stream_destroy(self, stream: Any) -> None: ...
    def stream_synchronize(self, stream: Any) -> None: ...
    def stream_query(self, stream: Any) -> bool: ...
    def stream_wait_event(self, stream: Any, event: Any) -> None: ...
    def event_create(self) -> Any: ...
    def event_destroy(self, event: Any) -> None: ...
    def event_record(self, event: Any, stream: Any) -> None: ...
    def event_synchronize(self, event: Any) -> None: ...
    def event_query(self, event: Any) -> bool: ...
    def ipc_export(self, ptr: int, nbytes: int) -> bytes: ...
    def ipc_import(self, payload: bytes, nbytes: int) -> int: ...
    def ipc_close(self, ptr: int, payload: bytes) -> None: ...
    def device_tensor(self, ptr: int, nbytes: int, owner: Any) -> Any: ...
    def tensor_device_type(self) -> str: ...


@dataclass
class _DeviceAlloc:
    ptr: int


@dataclass
class _PinnedAlloc:
    ptr: int


@dataclass
class _SharedHost:
    seg: shm.Segment


@dataclass
class _ImportedDevice:
    ptr: int
    payload: bytes


_DEV, _SHM = b"dev:", b"shm:"


def _poll(query: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    delay = 20e-6
    while not query():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} not complete within {timeout} s")
        time.sleep(delay)
        delay = min(delay * 2, 1e-3)


class RuntimePlatform(Platform):
    """A platform backed by a :class:`DeviceRuntime` (see module docstring)."""

    name = "runtime"

    def __init__(self, device: int = 0, runtime: DeviceRuntime | None = None) -> None:
        super().__init__(device)
        self.runtime = runtime if runtime is not None else self._default_runtime(device)
        count = self.runtime.device_count()
        if device >= count:
            raise ValueError(f"device {device} does not exist: {self.name} sees {count} device(s)")
        self.runtime.set_device(device)
        self._sync_stream = self.runtime.stream_create()
        self._batch_ok = True

    def _default_runtime(self, device: int) -> DeviceRuntime:
        raise TypeError(f"{type(self).__name__} needs a runtime")

    # ------------------------------------------------------------------ memory
    def _alloc(self, nbytes: int, medium: Medium, shareable: bool) -> tuple[int, Any]:
        rt = self.runtime
        if medium is Medium.HBM:
            ptr = rt.malloc(nbytes)
            return ptr, _DeviceAlloc(ptr)
        if not shareable:
            ptr = rt.host_alloc(nbytes)
            return ptr, _PinnedAlloc(ptr)
        seg = shm.create(nbytes)
        try:
            rt.host_register(seg.ptr, nbytes)
        except BaseException:
            seg.close()
            seg.unlink()
            raise
        return seg.ptr, _SharedHost(seg)

    def _alloc_named(self, name: str, nbytes: int) -> tuple[int, Any, bool]:
        seg, created = shm.open_named(name, nbytes)
        try:
            self.runtime.host_register(seg.ptr, nbytes)
        except BaseException:
            seg.close()
            raise
        return seg.ptr, _SharedHost(seg), created

    def _unlink_named(self, name: str) -> bool:
        return shm.unlink_named(name)

    def _free(self, buf: Buffer) -> None:
        impl, buf.impl = buf.impl, None
        if isinstance(impl, _DeviceAlloc):
            self.runtime.free(impl.ptr)
        elif isinstance(impl, _PinnedAlloc):
            self.runtime.host_free(impl.ptr)
        elif isinstance(impl, _SharedHost):
            try:
                self.runtime.host_unregister(impl.seg.ptr)
            finally:
                impl.seg.close()
                if impl.seg.owner:
                    impl.seg.unlink()

    def _register_host(self, ptr: int, nbytes: int) -> Any:
        self.runtime.host_register(ptr, nbytes)
        return ptr

    def _unregister_host(self, buf: Buffer) -> None:
        self.runtime.host_unregister(buf.ptr)

    def _wrap_info(self, obj: Any, medium: Medium | None) -> tuple[int, int, Medium]:
        dev = getattr(obj, "device", None)
        dev_type = getattr(dev, "type", "cpu")
        if dev_type == self.runtime.tensor_device_type():
            if not obj.is_contiguous():
                raise ValueError("wrap needs a contiguous tensor")
            if medium is Medium.DRAM:
                raise ValueError(f"a tensor on {dev} is HBM, not DRAM")
            return int(obj.data_ptr()), int(obj.numel() * obj.element_size()), Medium.HBM
        if dev_type != "cpu":
            raise ValueError(f"{self.name} cannot wrap a tensor on {dev}")
        if medium is Medium.HBM:
            raise ValueError("host memory cannot be wrapped as HBM on a device platform")
        ptr, n = host_wrap_info(obj)
        return ptr, n, Medium.DRAM

    def _prepare_wrap(self, buf: Buffer) -> None:
        if buf.medium is Medium.DRAM:  # device DMA (and batched copies) need pinned memory
            self.runtime.host_register(buf.ptr, buf.nbytes)

    def _unwrap(self, buf: Buffer) -> None:
        if buf.medium is Medium.DRAM:
            self.runtime.host_unregister(buf.ptr)

    def _tensor_view(self, buf: Buffer) -> Any:
        if buf.medium is Medium.HBM:
            return self.runtime.device_tensor(buf.ptr, buf.nbytes, buf)
        return super()._tensor_view(buf)

    # ------------------------------------------------------------------ IPC
    def _export(self, buf: Buffer) -> bytes:
        impl = buf.impl
        if isinstance(impl, _SharedHost):
            return _SHM + impl.seg.name.encode()
        if isinstance(impl, _DeviceAlloc):
            return _DEV + self.runtime.ipc_export(impl.ptr, buf.nbytes)
        raise ValueError(f"{buf!r} is not exportable")

    def _import(self, rec: HandleRecord) -> tuple[int, Any]:
        payload = rec.payload
        if payload.startswith(_SHM):
            seg = shm.attach(payload[len(_SHM) :].decode(), rec.nbytes)
            try:
                self.runtime.host_register(seg.ptr, rec.nbytes)
            except BaseException:
                seg.close()
                raise
            return seg.ptr, _SharedHost(seg)
        if payload.startswith(_DEV):
            key = payload[len(_DEV) :]
            ptr = self.runtime.ipc_import(key, rec.nbytes)
            return ptr, _ImportedDevice(ptr, key)
        raise ValueError("IPC handle payload is neither device memory nor shared host memory")

    def _close_import(self, buf: Buffer) -> None:
        impl, buf.impl = buf.impl, None
        if isinstance(impl, _ImportedDevice):
            self.runtime.ipc_close(impl.ptr, impl.payload)
        elif isinstance(impl, _SharedHost):
            try:
                self.runtime.host_unregister(impl.seg.ptr)
            finally:
                impl.seg.close()

    # ------------------------------------------------------------------ copies
    def _copy(self, dst: int, src: int, nbytes: int, direction: Direction, stream: Stream | None) -> None:
        s = self._sync_stream if stream is None else stream.handle
        self.runtime.memcpy_async(dst, src, nbytes, int(direction), s)
        if stream is None:
            self._sync(s)

    def _batch_copy(self, batch: CopyBatch, directions: np.ndarray, stream: Stream | None) -> None:
        s = self._sync_stream if stream is None else stream.handle
        rt = self.runtime
        done = self._batch_ok and rt.memcpy_batch_async(batch.dst, batch.src, batch.nbytes, directions, s)
        if not done:
            self._batch_ok = False
            for d, sr, n, k in zip(
                batch.dst.tolist(), batch.src.tolist(), batch.nbytes.tolist(), directions.tolist()
            ):
                rt.memcpy_async(d, sr, n, k, s)
        if stream is None:
            self._sync(s)

    def _sync(self, s: Any) -> None:
        try:
            self.runtime.stream_synchronize(s)
        except Exception as e:
            raise TransferFailed(f"copy on {self.name}:{self.device} failed: {e}") from e

    # ------------------------------------------------------------------ streams, events
    def _stream_create(self) -> Any:
        return self.runtime.stream_create()

    def _stream_destroy(self, stream: Stream) -> None:
        try:
            self._sync(stream.handle)
        finally:
            self.runtime.stream_destroy(stream.handle)

    def _stream_synchronize(self, stream: Stream, timeout: float | None) -> None:
        if timeout is not None:
            _poll(lambda: self.runtime.stream_query(stream.handle), timeout, repr(stream))
        self._sync(stream.handle)

    def _stream_query(self, stream: Stream) -> bool:
        return self.runtime.stream_query(stream.handle)

    def _stream_wait_event(self, stream: Stream, event: Event) -> None:
        self.runtime.stream_wait_event(stream.handle, event.handle)

    def _event_create(self) -> Any:
        return self.runtime.event_create()

    def _event_destroy(self, handle: Any) -> None:
        try:
            self.runtime.event_destroy(handle)
        except Exception:  # noqa: BLE001 - at collection time, a dead context is fine
            pass

    def _event_record(self, event: Event, stream: Stream) -> None:
        self.runtime.event_record(event.handle, stream.handle)

    def _event_query(self, event: Event) -> bool:
        return self.runtime.event_query(event.handle)

    def _event_synchronize(self, event: Event, timeout: float | None) -> None:
        if timeout is not None:
            _poll(lambda: self.runtime.event_query(event.handle), timeout, repr(event))
        try:
            self.runtime.event_synchronize(event.handle)
        except Exception as e:
            raise TransferFailed(f"work before {event!r} failed: {e}") from e

    # ------------------------------------------------------------------ info, lifecycle
    def _info(self) -> PlatformInfo:
        rt = self.runtime
        devices = []
        for i in range(rt.device_count()):
            free = total = None
            if i == self.device:
                free, total = rt.mem_info()
            devices.append(DeviceInfo(i, rt.device_name(i), total, free))
        return PlatformInfo(
            self.name, rt.name, tuple(devices), supports_ipc=True, supports_batch_copy=self._batch_ok
        )

    def _shutdown(self) -> None:
        self.runtime.stream_destroy(self._sync_stream)
