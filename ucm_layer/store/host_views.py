"""Buffer-protocol views of host memory by address, for file I/O straight into or out of it.

Only for memory the caller guarantees to be host memory that stays alive while the view
is used (a platform DRAM buffer: a cache slot, a pinned host buffer, a bounce area).
"""

from __future__ import annotations

import ctypes


def host_view(addr: int, nbytes: int) -> memoryview:
    """A writable ``memoryview`` of ``nbytes`` bytes of host memory at ``addr``."""
    if addr <= 0 or nbytes <= 0:
        raise ValueError(f"host_view needs a positive address and size, got {addr:#x}+{nbytes}")
    return memoryview((ctypes.c_ubyte * nbytes).from_address(addr)).cast("B")
