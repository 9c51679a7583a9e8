"""Address and size of host objects (numpy arrays, CPU torch tensors) for ``wrap``."""

from __future__ import annotations

from typing import Any

import numpy as np


def host_wrap_info(obj: Any) -> tuple[int, int]:
    """``(address, nbytes)`` of a contiguous, writable numpy array or CPU torch tensor."""
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise ValueError("wrap needs a C-contiguous array")
        if not obj.flags.writeable:
            raise ValueError("wrap needs a writable array (copies may write into it)")
        return int(obj.ctypes.data), int(obj.nbytes)
    data_ptr = getattr(obj, "data_ptr", None)
    if callable(data_ptr) and hasattr(obj, "is_contiguous"):
        if not obj.is_contiguous():
            raise ValueError("wrap needs a contiguous tensor")
        dev = getattr(obj, "device", None)
        if getattr(dev, "type", "cpu") != "cpu":
            raise ValueError(f"this platform cannot wrap a tensor on {dev}")
        return int(obj.data_ptr()), int(obj.numel() * obj.element_size())
    raise TypeError(f"wrap takes a numpy array or a torch tensor, got {type(obj).__name__}")
