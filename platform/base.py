"""The ``Platform`` contract: one device API for the sim, CUDA and Ascend backends.

Template methods: the public methods below validate their arguments, keep the address
map of live buffers, and turn backend failures into kvfabric errors that name sizes,
media and the device. A backend implements only the underscore primitives
(``_alloc``, ``_copy``, ``_batch_copy``, streams, events, IPC), each of which may
assume valid arguments.

Memory ownership: ``alloc`` returns a buffer the platform owns until ``free``;
``import_handle`` maps memory owned by another process (``free`` unmaps it);
``register_host`` pins caller memory and ``wrap`` makes caller memory addressable
(``free`` only forgets it). ``close`` releases everything still live.

Copies: ``stream=None`` means synchronous (the bytes are in place when the call
returns); with a stream the copy is queued in order on that stream (see ``stream.py``).
Thread-safe: any thread may call any method.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from kvfabric.errors import KVFabricError, OutOfSpace, PlatformError
from kvfabric.platform import handles
from kvfabric.platform.addrmap import AddressMap
from kvfabric.platform.buffer import Buffer
from kvfabric.platform.primitives import BackendPrimitives
from kvfabric.platform.stream import Event, Stream
from kvfabric.platform.types import (
    BufferKind,
    CopyBatch,
    Direction,
    Endpoint,
    Medium,
    PlatformInfo,
    Span,
)


def _check_size(nbytes: object, what: str = "nbytes") -> int:
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)):
        raise TypeError(f"{what} must be an int, got {type(nbytes).__name__}")
    if nbytes <= 0:
        raise ValueError(f"{what} must be > 0, got {nbytes}")
    return int(nbytes)


class Platform(BackendPrimitives):
    """A device runtime seen through one contract (see the module docstring)."""

    name: ClassVar[str] = "abstract"
    #: Whether :meth:`record_external` works: True where the platform runs on a device
    #: runtime whose streams other libraries (torch) also hold raw handles to.
    supports_external_streams: ClassVar[bool] = False

    def __init__(self, device: int = 0) -> None:
        if isinstance(device, bool) or not isinstance(device, int) or device < 0:
            raise ValueError(f"device must be an index >= 0, got {device!r}")
        self.device = device
        self._addrmap = AddressMap()
        self._streams: weakref.WeakSet[Stream] = weakref.WeakSet()
        self._closed = False
        self._close_lock = threading.Lock()

    # ------------------------------------------------------------------ helpers
    def _where(self) -> str:
        return f"{self.name}:{self.device}"

    def _call(self, what: str | Callable[[], str], fn: Any, *args: Any) -> Any:
        """Run a backend primitive; wrap foreign errors into ``PlatformError``.

        ``what`` names the operation for the message; a callable is only evaluated on
        failure, which keeps string formatting off the copy fast path."""
        try:
            return fn(*args)
        except (KVFabricError, ValueError, TypeError, TimeoutError):
            raise
        except MemoryError as e:
            desc = what() if callable(what) else what
            raise OutOfSpace(f"{desc} on {self._where()}: out of memory ({e})") from e
        except Exception as e:  # backend errors of any vendor type
            desc = what() if callable(what) else what
            raise PlatformError(f"{desc} on {self._where()} failed: {type(e).__name__}: {e}") from e

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"platform {self._where()} is closed")

    def _own(self, buf: Buffer) -> Buffer:
        if not isinstance(buf, Buffer):
            raise TypeError(f"expected a Buffer, got {type(buf).__name__}")
        if buf.platform is not self:
            raise ValueError(f"{buf!r} belongs to another platform instance")
        buf.check_alive()
        return buf

    def _span(self, end: Endpoint, what: str) -> Span:
        if isinstance(end, Buffer):
            self._own(end)
            return Span(end, 0, end.nbytes)
        if isinstance(end, Span):
            self._own(end.buffer)
            return end
        raise TypeError(f"copy {what} must be a Buffer or Span, got {type(end).__name__}")

    # ------------------------------------------------------------------ memory
    def alloc(self, nbytes: int, medium: Medium | str = Medium.HBM, shareable: bool = False) -> Buffer:
        """Allocate ``nbytes`` on ``medium``; ``shareable`` buffers can be exported to
        other processes on this node. Raises ``OutOfSpace`` when it does not fit."""
        self._check_open()
        n = _check_size(nbytes)
        med = Medium.parse(medium)
        what = f"alloc of {n} B {med.value}{' shareable' if shareable else ''}"
        ptr, impl = self._call(what, self._alloc, n, med, bool(shareable))
        buf = Buffer(
            self, ptr, n, med, device=self.device, kind=BufferKind.OWNED, shareable=bool(shareable), impl=impl
        )
        self._addrmap.add(buf)
        return buf

    def alloc_named(self, name: str, nbytes: int) -> tuple[Buffer, bool]:
        """A shareable DRAM buffer that outlives this process under ``name``: created, or
        re-attached (contents intact) when it exists with this size; ``(buffer, created)``.
        ``free`` unmaps it; only :meth:`unlink_named` deletes it. For state a service must
        find again after a restart (the pool daemon's window and directory)."""
        self._check_open()
        n = _check_size(nbytes)
        ptr, impl, created = self._call(f"alloc_named {name!r} of {n} B", self._alloc_named, name, n)
        buf = Buffer(
            self, ptr, n, Medium.DRAM, device=self.device, kind=BufferKind.OWNED, shareable=True, impl=impl
        )
        self._addrmap.add(buf)
        return buf, created

    def unlink_named(self, name: str) -> bool:
        """Delete the named buffer ``name`` (mappings stay valid until freed)."""
        return bool(self._call(f"unlink_named {name!r}", self._unlink_named, name))

    def free(self, buffer: Buffer) -> None:
        """Release ``buffer`` (owned: free; imported: unmap; registered/wrapped: forget).

        The caller must have finished every stream operation that names it."""
        buf = self._own(buffer)
        self._addrmap.remove(buf)
        buf._freed = True
        what = f"free of {buf.nbytes} B {buf.medium.value} at {buf.ptr:#x}"
        if buf.kind is BufferKind.OWNED:
            self._call(what, self._free, buf)
        elif buf.kind is BufferKind.IMPORTED:
            self._call(what, self._close_import, buf)
        elif buf.kind is BufferKind.REGISTERED:
            self._call(what, self._unregister_host, buf)
        else:
            self._call(what, self._unwrap, buf)

    def register_host(self, ptr: int, nbytes: int) -> Buffer:
        """Pin caller-owned host memory ``[ptr, ptr + nbytes)`` for device DMA and make it
        addressable by copies. The caller keeps it alive until ``free``."""
        self._check_open()
        n = _check_size(nbytes)
        if isinstance(ptr, bool) or not isinstance(ptr, (int, np.integer)) or ptr <= 0:
            raise ValueError(f"ptr must be a positive address, got {ptr!r}")
        buf = Buffer(
            self, int(ptr), n, Medium.DRAM, device=self.device, kind=BufferKind.REGISTERED, shareable=False
        )
        self._addrmap.add(buf)  # refuses overlap with live buffers before pinning anything
        try:
            buf.impl = self._call(
                f"register_host of {n} B at {int(ptr):#x}", self._register_host, int(ptr), n
            )
        except BaseException:
            self._addrmap.remove(buf)
            raise
        return buf

    def wrap(self, obj: Any, medium: Medium | str | None = None) -> Buffer:
        """Make a contiguous numpy array or torch tensor addressable by copies, without
        copying it (device platforms also pin host memory for DMA until ``free``). The
        buffer keeps ``obj`` alive until ``free``."""
        self._check_open()
        ptr, nbytes, med = self._call(
            "wrap", self._wrap_info, obj, None if medium is None else Medium.parse(medium)
        )
        _check_size(nbytes, "wrapped object size")
        buf = Buffer(
            self, ptr, nbytes, med, device=self.device, kind=BufferKind.WRAPPED, shareable=False, impl=obj
        )
        self._addrmap.add(buf)
        try:
            self._call("wrap", self._prepare_wrap, buf)
        except BaseException:
            self._addrmap.remove(buf)
            raise
        return buf

    def find(self, ptr: int, nbytes: int = 1) -> Span:
        """The live buffer span holding ``[ptr, ptr + nbytes)``; ``ValueError`` if none."""
        buf, off = self._addrmap.find(int(ptr), _check_size(nbytes))
        return Span(buf, off, int(nbytes))

    def media_of(self, ptrs: np.ndarray, nbytes: np.ndarray, what: str = "range") -> np.ndarray:
        """Where each range ``[ptrs[i], ptrs[i] + nbytes[i])`` lives, vectorised: a uint8 array
        of medium codes (0 DRAM, 1 HBM). ``ValueError`` naming the first range that is not
        inside one live buffer of this platform. O(1) Python work for any number of ranges."""
        p = np.ascontiguousarray(ptrs, dtype=np.uint64).reshape(-1)
        n = np.ascontiguousarray(nbytes, dtype=np.uint64).reshape(-1)
        if p.shape != n.shape:
            raise ValueError(f"media_of needs as many sizes as addresses, got {n.size} and {p.size}")
        return self._addrmap.media_of(p, n, what)

    def buffers(self) -> list[Buffer]:
        """Every live buffer, in address order."""
        return self._addrmap.buffers()

    # ------------------------------------------------------------------ copies
    def copy(
        self, dst: Endpoint, src: Endpoint, nbytes: int | None = None, stream: Stream | None = None
    ) -> None:
        """Copy ``nbytes`` (default: all of ``src``) from ``src`` to ``dst``.

        The direction comes from the two media. Without a stream the bytes are in place
        on return; with one the copy is queued behind the stream's earlier work."""
        d, s = self._span(dst, "dst"), self._span(src, "src")
        n = s.nbytes if nbytes is None else _check_size(nbytes)
        if n > s.nbytes or n > d.nbytes:
            raise ValueError(
                f"copy of {n} B does not fit: src span has {s.nbytes} B ({s.medium.value}), "
                f"dst span has {d.nbytes} B ({d.medium.value})"
            )
        if d.buffer is s.buffer and d.offset < s.offset + n and s.offset < d.offset + n:
            raise ValueError(f"copy ranges overlap inside {d.buffer!r}")
        self._check_stream(stream)
        direction = Direction.of(d.medium, s.medium)
        self._call(
            lambda: f"copy {direction.name} of {n} B {s.ptr:#x} -> {d.ptr:#x}",
            self._copy,
            d.ptr,
            s.ptr,
            n,
            direction,
            stream,
        )

    def batch_copy(self, items: CopyBatch | Any, stream: Stream | None = None) -> None:
        """Copy many ``(dst, src, nbytes)`` pieces as one submission.

        ``items`` is a :class:`CopyBatch` of address arrays, or an iterable of tuples of
        buffers, spans or addresses. Every range must lie in a live buffer of this
        platform (checked, vectorised, before anything is copied)."""
        batch = items if isinstance(items, CopyBatch) else CopyBatch.from_items(items)
        n = len(batch)
        if n == 0:
            return
        if not (batch.nbytes.all() if n > 4 else all(batch.nbytes.tolist())):
            raise ValueError(f"batch item {int(np.flatnonzero(batch.nbytes == 0)[0])}: nbytes is 0")
        self._check_stream(stream)
        dst_m = self._addrmap.media_of(batch.dst, batch.nbytes, "dst")
        src_m = self._addrmap.media_of(batch.src, batch.nbytes, "src")
        directions = src_m * np.uint8(2) + dst_m
        self._call(
            lambda: f"batch copy of {len(batch)} pieces ({batch.total_bytes} B)",
            self._batch_copy,
            batch,
            directions,
            stream,
        )

    def _check_stream(self, stream: Stream | None) -> None:
        if stream is None:
            return
        if not isinstance(stream, Stream) or stream.platform is not self:
            raise TypeError("stream must be a Stream made by this platform, or None")
        stream._check()

    # ------------------------------------------------------------------ streams
    def stream(self) -> Stream:
        """A new stream; closed by ``Stream.close`` or with the platform."""
        self._check_open()
        s = Stream(self, self._call("stream create", self._stream_create))
        self._streams.add(s)
        return s

    def event(self) -> Event:
        """A new event; its backend handle is released when the event is collected."""
        self._check_open()
        handle = self._call("event create", self._event_create)
        ev = Event(self, handle)
        weakref.finalize(ev, self._event_destroy, handle)
        return ev

    def framework_stream(self) -> Any | None:
        """The raw handle of the ML framework's *current* stream on this platform's device
        (the stream a torch forward on this device queued its kernels on), read now; None
        where there is no such stream to order after: the work is synchronous on the host
        (sim), or the framework never initialised this device, so it queued nothing.

        Read it right before :meth:`record_external` and never cache it: the current stream
        can change between steps, and some frameworks (torch_npu) drain their host-side
        task queue when the handle is read."""
        return None

    def record_external(self, stream_handle: Any) -> Event:
        """A new :class:`Event` recorded on a stream this platform did not create, given by
        its raw runtime handle (CUDA: the ``cudaStream_t`` as an int, e.g. torch's
        ``current_stream().cuda_stream``, 0 being the legacy default stream; ACL: the
        ``aclrtStream``). The event completes when the work queued on that stream so far
        has; a stream of this platform orders after it with ``Stream.wait_event``. The
        stream must belong to this platform's device and stay alive until the event
        completes. No host synchronisation. ``NotImplementedError`` where
        :attr:`supports_external_streams` is False."""
        self._check_open()
        if not self.supports_external_streams:
            raise NotImplementedError(f"{self._where()} has no external streams to record on")
        if stream_handle is None or isinstance(stream_handle, bool):
            raise TypeError(f"record_external needs a raw stream handle, got {stream_handle!r}")
        ev = self.event()
        self._call("event record on an external stream", self._event_record_external, ev, stream_handle)
        return ev

    def _event_record_external(self, event: Event, stream_handle: Any) -> None:
        """Record ``event`` on the raw stream ``stream_handle`` (backends that set
        :attr:`supports_external_streams`)."""
        raise NotImplementedError(f"{self._where()} has no external streams to record on")

    def _close_stream(self, stream: Stream) -> None:
        self._streams.discard(stream)
        self._call("stream close", self._stream_destroy, stream)

    # ------------------------------------------------------------------ IPC
    def export_handle(self, buffer: Buffer) -> bytes:
        """Bytes another process on this node passes to ``import_handle`` to map the same
        memory. Only owned, shareable buffers can be exported."""
        buf = self._own(buffer)
        if buf.kind is not BufferKind.OWNED or not buf.shareable:
            raise ValueError(f"{buf!r} cannot be exported: allocate it with shareable=True")
        payload = self._call(f"export of {buf.nbytes} B {buf.medium.value}", self._export, buf)
        return handles.encode(self.name, buf.medium, buf.nbytes, os.getpid(), buf.device, payload)

    def import_handle(self, handle: bytes) -> Buffer:
        """Map memory exported by ``export_handle`` (of this platform) into this process."""
        self._check_open()
        rec = handles.decode(handle, self.name)
        med = Medium(rec.medium)
        ptr, impl = self._call(
            f"import of {rec.nbytes} B {med.value} from pid {rec.owner_pid}", self._import, rec
        )
        buf = Buffer(
            self,
            ptr,
            rec.nbytes,
            med,
            device=self.device,
            kind=BufferKind.IMPORTED,
            shareable=True,
            impl=impl,
        )
        self._addrmap.add(buf)
        return buf

    # ------------------------------------------------------------------ lifecycle
    def info(self) -> PlatformInfo:
        return self._call("info", self._info)

    def close(self) -> None:
        """Close streams, then release every live buffer. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        for s in list(self._streams):
            s.close()
        for buf in reversed(self._addrmap.buffers()):
            self.free(buf)
        self._shutdown()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Platform:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._where()})"
