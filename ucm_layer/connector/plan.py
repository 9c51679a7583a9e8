"""The step plan the scheduler role sends the worker role (inside vLLM's connector metadata).

Plain, picklable values only: vLLM ships the metadata to worker processes. Block ids
are *base* ids (rank 0, group 0); each worker stamps its own rank and the transfer's KV
cache group before it touches a store (MLA: every rank uses rank 0's ids). Models with
several KV cache groups (vLLM's hybrid manager) get one transfer per request and group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Transfer:
    """Blocks of one request to load or dump: ids ``(n, 16)`` and engine block ids ``(n,)``
    of one KV cache group. ``transient``: the group's blocks may be freed while the
    request runs (a sliding window), so a dump must release them before the step ends."""

    req_id: str
    ids: np.ndarray
    blocks: np.ndarray
    requested_tokens: int = 0  # for spans: the request's tokens when it was planned
    block_size: int = 0  # tokens per block (for spans)
    group: int = 0  # the KV cache group the engine blocks belong to
    transient: bool = False
    seq: int = -1  # a dump's number for its KV events report (-1: events off, or a load)

    def __post_init__(self) -> None:
        if self.ids.ndim != 2 or self.ids.shape[0] != self.blocks.size:
            raise ValueError(f"Transfer of {self.req_id}: {self.ids.shape} ids for {self.blocks.size} blocks")


@dataclass
class StepPlan:
    """What the workers do this step.

    ``loads`` must be in the KV cache before the forward reads it (synchronous loads);
    ``async_loads`` are started by the workers and finish while the engine keeps
    stepping: their requests wait (vLLM's ``WAITING_FOR_REMOTE_KVS``) until every worker
    reports them in ``get_finished``, so no forward reads those blocks before; ``dumps`` are stored
    after the forward wrote them; ``finished`` are requests whose blocks the scheduler
    keeps alive until every worker reports their dumps released (``get_finished``);
    ``preempted`` are requests whose in-flight dumps must finish before their blocks are
    reused; ``repaired`` are requests the scheduler set back after a failed load since
    the last plan (vLLM recomputes them from the failed block): a worker that stopped
    dumping such a request, because the KV it computed on top of the failed load is not
    to be stored, dumps it again from this plan on. ``readers`` are the requests that
    start this step on engine blocks loaded in it, with those blocks: the loaders
    themselves and requests vLLM's prefix cache lets share the blocks. If one of the
    blocks fails, the KV computed this step by each of its readers is wrong.
    ``idle``: no request computes this step; a worker with asynchronous loads in flight
    may then wait a little for one to end instead of returning at once (the engine would
    only call it again straight away, and that busy loop takes the interpreter from the
    threads doing the load).
    ``traces`` (tracing on only): the W3C ``traceparent`` of the root span of every
    request with a transfer in the plan or finished since the last plan, so the worker's
    spans are children of the scheduler's root across processes; ``first_blocks``: the
    engine block holding the first token of each request finished since the last plan
    (the sparse backend keys requests by it).
    """

    loads: list[Transfer] = field(default_factory=list)
    async_loads: list[Transfer] = field(default_factory=list)
    dumps: list[Transfer] = field(default_factory=list)
    finished: set[str] = field(default_factory=set)
    preempted: set[str] = field(default_factory=set)
    repaired: set[str] = field(default_factory=set)
    readers: dict[str, set[int]] = field(default_factory=dict)
    idle: bool = False  # no request computes this step (only transfers are in flight)
    traces: dict[str, str] = field(default_factory=dict)
    first_blocks: dict[str, int] = field(default_factory=dict)

    def is_empty(self) -> bool:
        return not (
            self.loads or self.async_loads or self.dumps or self.finished or self.preempted or self.repaired
        )
