"""``HostRuntime``: a small stateful stand-in for a CUDA/ACL device runtime.

It implements :class:`kvfabric.platform.runtime.DeviceRuntime` on host memory so the
CUDA and Ascend platform classes run the platform contract suite on machines without
either device. It is deliberately strict and deliberately asynchronous:

* "device" memory lives in shared-memory segments (so IPC across processes works), host
  memory is pinned (``host_alloc``) or registered; each copy's kind is checked against
  where its two ends really live, so a wrong direction fails like a real runtime would;
* copies queued on a stream run only when something waits for that stream (synchronize,
  an event, a dependent stream), so a missing synchronization shows up as stale bytes;
* ``fail_next_copy()`` makes a queued copy fail, reported at the next synchronize.
"""

from __future__ import annotations

import ctypes
import mmap
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvfabric.platform import shm


class FakeRuntimeError(RuntimeError):
    pass


@dataclass
class FakeStream:
    queue: deque = field(default_factory=deque)
    destroyed: bool = False
    error: FakeRuntimeError | None = None  # first failure since the last synchronize
    recent: FakeRuntimeError | None = None  # first failure since the last event marker


@dataclass
class FakeEvent:
    stream: FakeStream | None = None
    ticket: object | None = None
    error: FakeRuntimeError | None = None


class HostRuntime:
    """See module docstring. ``batch``: whether ``memcpy_batch_async`` is offered."""

    name = "fake host runtime"

    def __init__(self, batch: bool = True, devices: int = 1, capacity: int = 1 << 34) -> None:
        self.batch = batch
        self.devices = devices
        self.capacity = capacity
        self.device = 0
        self.dev: dict[int, shm.Segment] = {}  # base -> segment (allocated here)
        self.imported: dict[int, shm.Segment] = {}
        self.pinned: dict[int, tuple[mmap.mmap, np.ndarray]] = {}
        self.registered: dict[int, int] = {}
        self.fail_copies = 0
        self.calls: dict[str, int] = {}
        self.batch_calls = 0

    # ---------------------------------------------------------------- bookkeeping
    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def _is_device(self, ptr: int, n: int) -> bool:
        for table in (self.dev, self.imported):
            for base, seg in table.items():
                if base <= ptr and ptr + n <= base + seg.nbytes:
                    return True
        return False

    def _is_host(self, ptr: int, n: int) -> bool:
        for base, (_, arr) in self.pinned.items():
            if base <= ptr and ptr + n <= base + arr.nbytes:
                return True
        return any(base <= ptr and ptr + n <= base + size for base, size in self.registered.items())

    def _check_end(self, ptr: int, n: int, device: bool, what: str) -> None:
        ok = self._is_device(ptr, n) if device else self._is_host(ptr, n)
        if not ok:
            raise FakeRuntimeError(
                f"{what} {ptr:#x}+{n} is not {'device' if device else 'pinned/registered host'} memory"
            )

    def fail_next_copy(self, count: int = 1) -> None:
        self.fail_copies += count

    # ---------------------------------------------------------------- devices, memory
    def device_count(self) -> int:
        return self.devices

    def set_device(self, index: int) -> None:
        if not 0 <= index < self.devices:
            raise FakeRuntimeError(f"invalid device {index}")
        self.device = index

    def device_name(self, index: int) -> str:
        return f"fake device {index}"

    def mem_info(self) -> tuple[int, int]:
        used = sum(s.nbytes for s in self.dev.values())
        return self.capacity - used, self.capacity

    def malloc(self, nbytes: int) -> int:
        used = sum(s.nbytes for s in self.dev.values())
        if used + nbytes > self.capacity:
            raise MemoryError(f"fake device out of memory: {used} + {nbytes} > {self.capacity}")
        seg = shm.create(nbytes)
        self.dev[seg.ptr] = seg
        return seg.ptr

    def free(self, ptr: int) -> None:
        seg = self.dev.pop(ptr, None)
        if seg is None:
            raise FakeRuntimeError(f"free of unknown device pointer {ptr:#x}")
        seg.close()
        seg.unlink()

    def host_alloc(self, nbytes: int) -> int:
        mm = mmap.mmap(-1, nbytes)
        arr = np.frombuffer(mm, np.uint8)
        self.pinned[int(arr.ctypes.data)] = (mm, arr)
        return int(arr.ctypes.data)

    def host_free(self, ptr: int) -> None:
        if self.pinned.pop(ptr, None) is None:
            raise FakeRuntimeError(f"host_free of unknown pointer {ptr:#x}")

    def host_register(self, ptr: int, nbytes: int) -> None:
        if ptr in self.registered:
            raise FakeRuntimeError(f"host memory {ptr:#x} is already registered")
        self.registered[ptr] = nbytes

    def host_unregister(self, ptr: int) -> None:
        if self.registered.pop(ptr, None) is None:
            raise FakeRuntimeError(f"host_unregister of unregistered pointer {ptr:#x}")

    # ---------------------------------------------------------------- copies
    def memcpy_async(self, dst: int, src: int, nbytes: int, kind: int, stream: FakeStream) -> None:
        self._count("memcpy_async")
        if stream.destroyed:
            raise FakeRuntimeError("copy on a destroyed stream")
        self._check_end(src, nbytes, kind >= 2, "src")
        self._check_end(dst, nbytes, kind % 2 == 1, "dst")
        fail = self.fail_copies > 0
        self.fail_copies -= int(fail)

        def op() -> None:
            if fail:
                ctypes.memmove(dst, src, nbytes // 2)
                raise FakeRuntimeError(f"injected copy failure ({nbytes} B)")
            ctypes.memmove(dst, src, nbytes)

        stream.queue.append(op)

    def memcpy_batch_async(
        self, dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray, kinds: np.ndarray, stream: FakeStream
    ) -> bool:
        if not self.batch:
            return False
        self.batch_calls += 1
        for d, s, n, k in zip(dst.tolist(), src.tolist(), nbytes.tolist(), kinds.tolist()):
            self.memcpy_async(d, s, n, k, stream)
        return True

    # ---------------------------------------------------------------- streams, events
    def _drain(self, stream: FakeStream, until: object | None = None) -> None:
        """Run queued ops in order (up to the marker ``until``); keep the first error."""
        while stream.queue:
            op = stream.queue.popleft()
            self._run(stream, op)
            if op is until:
                break

    @staticmethod
    def _run(stream: FakeStream, op: Any) -> None:
        try:
            op()
        except FakeRuntimeError as e:
            stream.error = stream.error or e
            stream.recent = stream.recent or e

    def stream_create(self) -> FakeStream:
        return FakeStream()

    def stream_destroy(self, stream: FakeStream) -> None:
        if stream.queue:
            raise FakeRuntimeError("stream destroyed with work queued (synchronize first)")
        stream.destroyed = True

    def stream_synchronize(self, stream: FakeStream) -> None:
        self._drain(stream)
        err, stream.error, stream.recent = stream.error, None, None
        if err is not None:
            raise err

    def stream_query(self, stream: FakeStream) -> bool:
        if stream.queue:  # make progress one op per poll, like a device would
            self._run(stream, stream.queue.popleft())
        return not stream.queue

    def stream_wait_event(self, stream: FakeStream, event: FakeEvent) -> None:
        src, ticket = event.stream, event.ticket
        if src is None:
            return

        def wait() -> None:
            if ticket in src.queue:
                self._drain(src, until=ticket)

        stream.queue.append(wait)

    def event_create(self) -> FakeEvent:
        return FakeEvent()

    def event_destroy(self, event: FakeEvent) -> None:
        event.stream = None

    def event_record(self, event: FakeEvent, stream: FakeStream) -> None:
        def ticket() -> None:  # a unique marker job: the event reports failures since the last one
            event.error, stream.recent = stream.recent, None

        stream.queue.append(ticket)
        event.stream, event.ticket, event.error = stream, ticket, None

    def event_synchronize(self, event: FakeEvent) -> None:
        if event.stream is not None:
            if event.ticket in event.stream.queue:
                self._drain(event.stream, until=event.ticket)
            if event.error is not None:
                raise event.error

    def event_query(self, event: FakeEvent) -> bool:
        return event.stream is None or event.ticket not in event.stream.queue

    # ---------------------------------------------------------------- IPC, views
    def ipc_export(self, ptr: int, nbytes: int) -> bytes:
        seg = self.dev.get(ptr)
        if seg is None:
            raise FakeRuntimeError(f"ipc export of {ptr:#x}: not the base of a device allocation")
        return seg.name.encode()

    def ipc_import(self, payload: bytes, nbytes: int) -> int:
        seg = shm.attach(payload.decode(), nbytes)
        self.imported[seg.ptr] = seg
        return seg.ptr

    def ipc_close(self, ptr: int, payload: bytes) -> None:
        seg = self.imported.pop(ptr, None)
        if seg is None:
            raise FakeRuntimeError(f"ipc close of unknown pointer {ptr:#x}")
        seg.close()

    def device_tensor(self, ptr: int, nbytes: int, owner: Any) -> Any:
        import torch

        raw = (ctypes.c_uint8 * nbytes).from_address(ptr)
        return torch.from_numpy(np.frombuffer(raw, np.uint8))

    def tensor_device_type(self) -> str:
        return "fakedev"
