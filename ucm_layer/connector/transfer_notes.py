"""What a worker's loads and dumps tell observability: trace spans and KV-events dump reports.

Both are off by default, and then free: nothing here is kept or computed unless the
worker's tracer is enabled (spans, ``tracing.py``) or ``report_dumps`` is on (KV events,
``events.py``).

Call order (the worker, :class:`~kvfabric.ucm_layer.connector.worker.WorkerSide`, drives
it; one thread):

* :meth:`TransferNotes.note` with every step plan it is handed (once per plan): the plan's
  requests' root spans (``plan.traces``, W3C ``traceparent`` strings) are kept until the
  request is :meth:`forget`-ten.
* Loads: :meth:`load_tiers` (a synchronous batch) or :meth:`load_issued` (an asynchronous
  one) at issue, the tier each request reads; :meth:`load_spans` when the statuses came.
* Dumps: :meth:`dump_batch` before a dump op is issued (all layers of a layer-wise step
  settle into the step's batch; :meth:`new_step` starts the next), :meth:`batch_settled`
  once per op when its statuses came (None: it failed whole): once every op of the batch
  did, one dump span per request and one :class:`DumpReport` per numbered dump.
  :meth:`not_dumped` reports the dumps a step skipped (their KV was computed on a failed
  load) as not stored. :meth:`take_reports` hands the reports over (the connector's
  ``get_kv_connector_kv_cache_events``) and forgets them.
* :meth:`requests_done` with a plan's ``first_blocks`` (its finished requests): a
  ``kvfabric.sparse`` span for each one this process's sparse backend selected blocks for.

Memory: at most 65536 root contexts are kept (the oldest dropped: a span without a
parent, never a wrong one); reports are tiny (a sequence number, a rank, a byte a block).
The batches hold the transfers they report on until settled.
"""

from __future__ import annotations

import time
from collections.abc import Container
from dataclasses import dataclass

import numpy as np

from kvfabric.ucm_layer.connector import tracing
from kvfabric.ucm_layer.connector.events import DumpReport
from kvfabric.ucm_layer.connector.plan import StepPlan, Transfer
from kvfabric.ucm_layer.connector.tracing import Tracer
from kvfabric.ucm_layer.store.base import BlockStatus, Store

MAX_TRACES = 65536


@dataclass
class DumpBatch:
    """One batched dump (all its layers, layer-wise) whose statuses spans and KV events
    reports wait for: ``ok`` is the AND of its ops' per-block statuses so far."""

    items: list[Transfer]
    start_ns: int
    ops: int  # ops (layers) still to settle
    ok: np.ndarray
    block_bytes: int
    tier: str


def served_by(store: Store | None, ids: np.ndarray) -> str:
    """The tier a load of ``ids`` (tagged) reads (tracing only): a pipeline's cache tier
    when it holds every block now, its lower tier when it holds none, the pipeline's name
    for a mix; a store's own name otherwise."""
    if store is None:
        return ""
    upper, lower = getattr(store, "upper", None), getattr(store, "lower", None)
    if upper is None or lower is None or not ids.shape[0]:
        return store.name
    held = int(np.count_nonzero(upper.lookup(ids)))
    return upper.name if held == ids.shape[0] else lower.name if held == 0 else store.name


class TransferNotes:
    """A worker rank's span and dump-report bookkeeping (see module docstring)."""

    def __init__(self, tracer: Tracer | None, rank: int, report_dumps: bool, dump_tier: str) -> None:
        self.tracer = tracer or Tracer(None)
        self.rank = rank
        self.report_dumps = report_dumps  # KV events: report numbered dumps (events.py)
        self.dump_tier = dump_tier  # the tier a dump's success speaks for
        self._reports: list[DumpReport] = []
        self._traces: dict[str, str] = {}  # req_id -> its root span's traceparent
        self._load_tiers: dict[tuple[str, int], str] = {}  # async load -> tier at issue
        self._layer_batch: DumpBatch | None = None
        self._noted: StepPlan | None = None
        if self.tracer.enabled:  # the sparse backend of this process times its selections
            from kvfabric.ucm_layer.sparse.vllm import timing

            timing.enable()

    @property
    def tracking(self) -> bool:
        """Whether dumps' statuses feed spans or KV events reports."""
        return self.report_dumps or self.tracer.enabled

    def note(self, plan: StepPlan) -> None:
        """Take the plan's trace contexts (once per plan; nothing when tracing is off)."""
        if plan is self._noted:
            return
        self._noted = plan
        if plan.traces:
            self._traces.update(plan.traces)
            while len(self._traces) > MAX_TRACES:
                del self._traces[next(iter(self._traces))]

    def forget(self, req_id: str) -> None:
        """``req_id`` is done here: its root context goes."""
        if self._traces:
            self._traces.pop(req_id, None)

    # ------------------------------------------------------------------ loads
    def load_tiers(self, store: Store | None, ids: np.ndarray, loads: list[Transfer]) -> list[str] | None:
        """The tier each of ``loads`` (whose tagged ids ``ids`` are, in order) reads now;
        None with tracing off."""
        if not self.tracer.enabled:
            return None
        tiers, row = [], 0
        for t in loads:
            tiers.append(served_by(store, ids[row : row + t.blocks.size]))
            row += t.blocks.size
        return tiers

    def load_issued(self, t: Transfer, store: Store | None, tagged: np.ndarray) -> None:
        """An asynchronous load of ``t`` (ids ``tagged``) was issued: the tier it reads."""
        if self.tracer.enabled:
            self._load_tiers[(t.req_id, t.group)] = served_by(store, tagged)

    def load_tier(self, t: Transfer) -> str:
        """The tier :meth:`load_issued` noted for ``t``'s load (forgotten now)."""
        return self._load_tiers.pop((t.req_id, t.group), "") if self._load_tiers else ""

    def load_spans(
        self,
        items: list[Transfer],
        status: np.ndarray | None,
        start_ns: int,
        block_bytes: int,
        tiers: list[str] | None = None,
    ) -> None:
        """One load span per request of a batched load, under the request's root (no-op
        with tracing off)."""
        if not self.tracer.enabled:
            return
        end_ns, row = time.time_ns(), 0
        for i, t in enumerate(items):
            n = int(t.blocks.size)
            ok = n if status is None else int((status[row : row + n] == BlockStatus.OK).sum())
            row += n
            hit = ok * t.block_size
            self.tracer.record(
                tracing.LOAD,
                start_ns,
                end_ns,
                self._traces.get(t.req_id),
                req_id=t.req_id,
                blocks=ok,
                bytes=ok * block_bytes,
                requested_tokens=t.requested_tokens,
                hit_tokens=hit,
                hit_rate=hit / t.requested_tokens if t.requested_tokens else 0.0,
                store_tier=tiers[i] if tiers else "",
            )

    # ------------------------------------------------------------------ dumps
    def new_step(self) -> None:
        """The step's dumps were all issued: the next layer 0 starts a new batch."""
        self._layer_batch = None

    def dump_batch(
        self, items: list[Transfer], blocks: np.ndarray, layer: int | None, num_layers: int, block_bytes: int
    ) -> DumpBatch:
        """The batch a dump op settles into: a new one, or (layer-wise, after layer 0) the
        step's batch whose other layers are in flight."""
        if layer is not None and layer > 0 and self._layer_batch is not None:
            return self._layer_batch
        ops = num_layers if layer is not None else 1
        batch = DumpBatch(items, time.time_ns(), ops, np.ones(blocks.size, bool), block_bytes, self.dump_tier)
        if layer is not None:
            self._layer_batch = batch
        return batch

    def batch_settled(self, batch: DumpBatch, status: np.ndarray | None) -> None:
        """One op of ``batch`` settled (``status`` None: it failed whole); once every op did,
        the batch's dump spans and KV events reports."""
        if status is None:
            batch.ok[:] = False
        else:
            batch.ok &= status == BlockStatus.OK
        batch.ops -= 1
        if batch.ops > 0:
            return
        end_ns, row = time.time_ns(), 0
        for t in batch.items:
            n = int(t.blocks.size)
            ok = batch.ok[row : row + n]
            row += n
            if self.report_dumps and t.seq >= 0:
                self._reports.append(DumpReport(t.seq, self.rank, ok.astype(np.uint8).tobytes()))
            if self.tracer.enabled:
                good = int(np.count_nonzero(ok))
                self.tracer.record(
                    tracing.DUMP,
                    batch.start_ns,
                    end_ns,
                    self._traces.get(t.req_id),
                    req_id=t.req_id,
                    blocks=good,
                    bytes=good * batch.block_bytes,
                    store_tier=batch.tier,
                )

    def not_dumped(self, planned: list[Transfer], dumped: list[Transfer]) -> None:
        """KV events: the numbered dumps of ``planned`` not in ``dumped`` (their KV was
        computed on a failed load) are reported as not stored."""
        if not self.report_dumps or len(dumped) >= len(planned):
            return
        kept = {id(t) for t in dumped}
        for t in planned:
            if id(t) not in kept and t.seq >= 0:
                self._reports.append(DumpReport(t.seq, self.rank, bytes(int(t.blocks.size))))

    def take_reports(self) -> list[DumpReport]:
        """KV events: the numbered dumps this rank's store answered for since the last call
        (``get_kv_connector_kv_cache_events``)."""
        out, self._reports = self._reports, []
        return out

    # ------------------------------------------------------------------ requests
    def requests_done(self, plan: StepPlan, dumping: Container[str]) -> None:
        """The plan's finished requests (``first_blocks``): their sparse spans; the root
        context of each with no dump in flight here (``dumping``) goes."""
        if not self.tracer.enabled or not plan.first_blocks:
            return
        self._sparse_spans(plan)
        for r in plan.first_blocks:
            if r not in dumping:  # nothing of it left to trace here
                self._traces.pop(r, None)

    def _sparse_spans(self, plan: StepPlan) -> None:
        """A ``kvfabric.sparse`` span for each finished request kvfabric's sparse backend
        selected blocks for in this process (tracing on; ``sparse/vllm/timing.py``)."""
        from kvfabric.ucm_layer.sparse.vllm import timing

        clock = timing.clock
        if clock is None:
            return
        for r, first in plan.first_blocks.items():
            sel = clock.take(first)
            if sel is None:
                continue
            self.tracer.record(
                tracing.SPARSE,
                sel.first_ns,
                sel.last_ns,
                plan.traces.get(r) or self._traces.get(r),
                req_id=r,
                sparse_algorithm=sel.algorithm,
                selection_s=sel.selection_s,
                sparse_layer_steps=sel.sparse_layer_steps,
            )
