"""Load-failure bookkeeping of a worker: the blocks vLLM must recompute, and the requests
whose dumps are skipped until repaired.

A block that fails to load is remembered until ``take()`` hands it to vLLM (which
recomputes it). The KV the forward computes on top of a failed block is wrong as well:
every request that read it this step (``plan.readers``) is poisoned, and its dumps are
left out (``dumpable``) until a plan names it ``repaired`` (or ``finished``).
"""

from __future__ import annotations

import numpy as np

from kvfabric.ucm_layer.connector.metrics import failure_counter, failure_reasons
from kvfabric.ucm_layer.connector.plan import StepPlan, Transfer


class LoadFailures:
    """Failed blocks and poisoned requests of one worker (not thread-safe)."""

    def __init__(self) -> None:
        self._failed: set[int] = set()
        self._readers: dict[str, set[int]] = {}  # requests on blocks loaded this step (plan)
        self._begun: StepPlan | None = None  # the plan of this step, once a hook saw it
        self._poisoned: set[str] = set()  # requests whose load failed, until repaired
        self._kept: tuple[list[Transfer], int, list[Transfer]] | None = None  # dumpable's last answer
        self._version = 0  # bumped whenever the poisoned set changes

    def begin(self, plan: StepPlan) -> None:
        """Once per plan, in whichever hook sees it first: vLLM calls ``start_load`` after
        the forward (and so after ``save_layer``) when the step has no synchronous load."""
        if plan is self._begun:
            return
        self._begun, self._readers = plan, plan.readers
        if self._poisoned:
            self._poisoned -= plan.repaired | plan.finished
            self._version += 1

    def record(self, blocks: np.ndarray, status: np.ndarray | None = None) -> dict[str, int]:
        """Remember ``blocks`` as failed, poison their readers and return the blocks new since
        the last ``take`` counted by reason: ``{"load_failed_<reason>": n}`` from their store
        ``status`` (None: the load raised, reason ``error``). A block that fails in several
        layers of one step counts once."""
        ids = [int(b) for b in blocks]
        new = np.array([b not in self._failed for b in ids], dtype=bool)
        failed = set(ids)
        self._failed |= failed
        hit = {r for r, reads in self._readers.items() if not reads.isdisjoint(failed)}
        if not hit <= self._poisoned:
            self._poisoned |= hit
            self._version += 1
        codes = np.full(len(ids), -1, np.int64) if status is None else np.asarray(status, np.int64)
        return {failure_counter(r): n for r, n in failure_reasons(codes[new]).items()}

    def take(self) -> set[int]:
        """The blocks that failed since the last call (for vLLM to recompute)."""
        out, self._failed = self._failed, set()
        return out

    def dumpable(self, dumps: list[Transfer]) -> list[Transfer]:
        """The planned dumps but those of poisoned requests; the same list object for the same
        ``dumps`` while nothing was poisoned or repaired in between."""
        if not self._poisoned:
            return dumps
        kept = self._kept
        if kept is None or kept[0] is not dumps or kept[1] != self._version:
            kept = self._kept = (dumps, self._version, [t for t in dumps if t.req_id not in self._poisoned])
        return kept[2]
