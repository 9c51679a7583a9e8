"""A stateful stand-in for a store's ``lookup_prefix`` (the seam ``SchedulerSide`` takes):
a set of present ids, the length of the present prefix, a switch to stop answering."""

from __future__ import annotations

import numpy as np


class StoreLookups:
    """Present ids; ``calls`` counts lookups; ``down`` makes them raise ``TimeoutError``."""

    def __init__(self) -> None:
        self.present: set[bytes] = set()
        self.calls = 0
        self.down = False

    def __call__(self, ids: np.ndarray) -> int:
        self.calls += 1
        if self.down:
            raise TimeoutError("store does not answer")
        n = 0
        for row in ids:
            if row.tobytes() not in self.present:
                break
            n += 1
        return n

    def add(self, ids: np.ndarray) -> None:
        self.present.update(r.tobytes() for r in ids)
