"""``BackendPrimitives``: what a platform backend implements.

``Platform`` (``base.py``) validates every argument before it calls one of these, so a
primitive may assume: buffers are alive and belong to this platform, sizes are positive,
ranges lie inside live buffers, streams and events are this platform's. Primitives raise
whatever their SDK raises; ``Platform`` wraps it into a kvfabric error naming the operation.
"""

from __future__ import annotations

import abc
import ctypes
from typing import TYPE_CHECKING, Any

import numpy as np

from kvfabric.platform.types import Direction, Medium, PlatformInfo

if TYPE_CHECKING:
    from kvfabric.platform.buffer import Buffer
    from kvfabric.platform.handles import HandleRecord
    from kvfabric.platform.stream import Event, Stream
    from kvfabric.platform.types import CopyBatch


class BackendPrimitives(abc.ABC):
    """The underscore primitives of the platform contract (see module docstring)."""

    name: str
    device: int

    def host_addressable(self, medium: Medium) -> bool:
        """Whether the CPU can load and store this medium's memory directly (then callers may
        memcpy between such buffers without a device copy). DRAM always; HBM only on sim."""
        return medium is Medium.DRAM

    # ------------------------------------------------------------------ views
    def _numpy_view(self, buf: Buffer) -> np.ndarray:
        if buf.medium is not Medium.DRAM:
            raise TypeError(f"{buf!r} is device memory on {self.name}; use .tensor()")
        raw = (ctypes.c_uint8 * buf.nbytes).from_address(buf.ptr)
        return np.frombuffer(raw, dtype=np.uint8)

    def _tensor_view(self, buf: Buffer) -> Any:
        import torch

        return torch.from_numpy(self._numpy_view(buf))

    @abc.abstractmethod
    def _alloc(self, nbytes: int, medium: Medium, shareable: bool) -> tuple[int, Any]:
        """Allocate; return (address, backend state). Raise OutOfSpace/MemoryError."""

    @abc.abstractmethod
    def _free(self, buf: Buffer) -> None: ...

    def _alloc_named(self, name: str, nbytes: int) -> tuple[int, Any, bool]:
        """Create or re-attach a persistent shareable DRAM buffer: (address, state, created)."""
        raise NotImplementedError(f"{self.name} has no named buffers")

    def _unlink_named(self, name: str) -> bool:
        raise NotImplementedError(f"{self.name} has no named buffers")

    @abc.abstractmethod
    def _copy(self, dst: int, src: int, nbytes: int, direction: Direction, stream: Stream | None) -> None: ...

    @abc.abstractmethod
    def _batch_copy(self, batch: CopyBatch, directions: np.ndarray, stream: Stream | None) -> None: ...

    @abc.abstractmethod
    def _stream_create(self) -> Any: ...

    @abc.abstractmethod
    def _stream_destroy(self, stream: Stream) -> None: ...

    @abc.abstractmethod
    def _stream_synchronize(self, stream: Stream, timeout: float | None) -> None: ...

    @abc.abstractmethod
    def _stream_query(self, stream: Stream) -> bool: ...

    @abc.abstractmethod
    def _stream_wait_event(self, stream: Stream, event: Event) -> None: ...

    @abc.abstractmethod
    def _event_create(self) -> Any: ...

    @abc.abstractmethod
    def _event_record(self, event: Event, stream: Stream) -> None: ...

    @abc.abstractmethod
    def _event_query(self, event: Event) -> bool: ...

    @abc.abstractmethod
    def _event_synchronize(self, event: Event, timeout: float | None) -> None: ...

    @abc.abstractmethod
    def _export(self, buf: Buffer) -> bytes: ...

    @abc.abstractmethod
    def _import(self, rec: HandleRecord) -> tuple[int, Any]: ...

    @abc.abstractmethod
    def _close_import(self, buf: Buffer) -> None: ...

    @abc.abstractmethod
    def _register_host(self, ptr: int, nbytes: int) -> Any: ...

    @abc.abstractmethod
    def _unregister_host(self, buf: Buffer) -> None: ...

    @abc.abstractmethod
    def _wrap_info(self, obj: Any, medium: Medium | None) -> tuple[int, int, Medium]:
        """``(address, nbytes, medium)`` of ``obj``, without side effects."""

    def _prepare_wrap(self, buf: Buffer) -> None:
        """Make a wrapped buffer usable for DMA if the backend must (nothing by default)."""

    def _unwrap(self, buf: Buffer) -> None:
        """Undo ``_prepare_wrap`` (nothing by default)."""

    @abc.abstractmethod
    def _info(self) -> PlatformInfo: ...

    def _event_destroy(self, handle: Any) -> None:
        """Release an event handle (called when its Event is collected)."""

    def _shutdown(self) -> None:
        """Release backend-wide resources after every buffer and stream is gone."""
