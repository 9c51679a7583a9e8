"""Fault injection for the sim platform: failed copies, stalled streams, allocation caps.

The injector is shared by every thread of one ``SimPlatform``; arm it from a test, run
the code under test, and the next matching operation fails the way a device would.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class CopyFault:
    """The ``nth`` copy submission from now on fails (``count`` in a row).

    ``torn``: the failing copy first writes half of its bytes, as an interrupted DMA may,
    so callers are tested against torn data, not only against clean failures.
    """

    nth: int = 1
    count: int = 1
    torn: bool = True


class FaultInjector:
    """Thread-safe fault state of one sim platform."""

    def __init__(self, alloc_cap: int | None = None) -> None:
        self._lock = threading.Lock()
        self._copy_fault: CopyFault | None = None
        self._seen = 0
        self._failed = 0
        self.alloc_cap = alloc_cap
        self.copies_failed = 0

    def fail_copy(self, nth: int = 1, count: int = 1, torn: bool = True) -> None:
        """Arm: the ``nth`` copy or batch submission from now fails, ``count`` times."""
        if nth < 1 or count < 1:
            raise ValueError(f"fail_copy needs nth >= 1 and count >= 1, got {nth}, {count}")
        with self._lock:
            self._copy_fault = CopyFault(nth, count, torn)
            self._seen = 0
            self._failed = 0

    def cap_alloc(self, nbytes: int | None) -> None:
        """Refuse allocations that would take the platform's owned bytes past ``nbytes``."""
        if nbytes is not None and nbytes < 0:
            raise ValueError(f"allocation cap must be >= 0, got {nbytes}")
        self.alloc_cap = nbytes

    def clear(self) -> None:
        with self._lock:
            self._copy_fault = None
            self.alloc_cap = None

    def next_copy(self) -> CopyFault | None:
        """Count one copy submission; the armed fault if this one must fail."""
        with self._lock:
            f = self._copy_fault
            if f is None:
                return None
            self._seen += 1
            if self._seen >= f.nth and self._failed < f.count:
                self._failed += 1
                self.copies_failed += 1
                if self._failed >= f.count:
                    self._copy_fault = None
                return f
            return None
