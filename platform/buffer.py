"""``Buffer``: a contiguous range of memory known to one platform.

Ownership: a buffer returned by ``Platform.alloc`` owns its memory until
``Platform.free``; one returned by ``import_handle`` maps memory another process owns;
one returned by ``register_host`` / ``wrap`` points at memory the caller owns and must
keep alive. After ``free`` the buffer is dead: every use raises ``ValueError``.
Views (``numpy()``, ``tensor()``) alias the memory; they must not be used after ``free``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from kvfabric.platform.types import BufferKind, Medium, Span

if TYPE_CHECKING:
    import torch

    from kvfabric.platform.base import Platform


class Buffer:
    """A platform buffer: base address, size, medium, device and ownership kind.

    ``impl`` is backend-private state (the mapping, the runtime allocation); only the
    backend that made the buffer reads it.
    """

    __slots__ = (
        "__weakref__",
        "_freed",
        "device",
        "impl",
        "kind",
        "medium",
        "nbytes",
        "platform",
        "ptr",
        "shareable",
    )

    def __init__(
        self,
        platform: Platform,
        ptr: int,
        nbytes: int,
        medium: Medium,
        *,
        device: int,
        kind: BufferKind,
        shareable: bool,
        impl: Any = None,
    ) -> None:
        self.platform = platform
        self.ptr = int(ptr)
        self.nbytes = int(nbytes)
        self.medium = medium
        self.device = device
        self.kind = kind
        self.shareable = shareable
        self.impl = impl
        self._freed = False

    @property
    def freed(self) -> bool:
        return self._freed

    @property
    def end(self) -> int:
        return self.ptr + self.nbytes

    def check_alive(self) -> None:
        if self._freed:
            raise ValueError(
                f"buffer {self.ptr:#x} ({self.nbytes} B, {self.medium.value}) was freed; "
                "it may not be used any more"
            )

    def at(self, offset: int, nbytes: int | None = None) -> Span:
        """The span ``[offset, offset + nbytes)`` of this buffer (to the end by default)."""
        self.check_alive()
        if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)):
            raise TypeError(f"offset must be an int, got {type(offset).__name__}")
        if nbytes is None:
            nbytes = self.nbytes - int(offset)
        if offset < 0 or nbytes <= 0 or offset + nbytes > self.nbytes:
            raise ValueError(
                f"span [{offset}, {offset + nbytes}) is outside buffer of {self.nbytes} B "
                f"({self.medium.value} at {self.ptr:#x})"
            )
        return Span(self, int(offset), int(nbytes))

    def numpy(self) -> np.ndarray:
        """A zero-copy uint8 view of the bytes (host-visible memory only)."""
        self.check_alive()
        return self.platform._numpy_view(self)

    def tensor(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A zero-copy 1-D torch view (on the buffer's device), reinterpreted as ``dtype``."""
        self.check_alive()
        t = self.platform._tensor_view(self)
        return t if dtype is None else t.view(dtype)

    def __repr__(self) -> str:
        state = "freed" if self._freed else self.kind.value
        return (
            f"Buffer({self.platform.name}:{self.device} {self.medium.value} "
            f"ptr={self.ptr:#x} nbytes={self.nbytes} {state}"
            f"{' shareable' if self.shareable else ''})"
        )
