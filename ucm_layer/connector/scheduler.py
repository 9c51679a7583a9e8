"""The scheduler role: which prefix blocks to load, which computed blocks to dump.

Works on plain values (see ``compat.py``), never on vLLM objects. Call order per
request, as vLLM's scheduler drives it:

1. ``num_new_matched_tokens(req, local)``, possibly several times, with ``local`` the
   block-aligned tokens vLLM's own prefix cache already has. It looks up the blocks
   *beyond* ``local`` and answers how many more tokens the store holds. Idempotent: a
   repeated call with the same arguments answers from the last lookup without asking the
   store again. It never claims the last token of the sequence (the engine must compute
   at least one token to sample from), and a store that fails or does not answer is a
   miss, logged once.
2. ``after_alloc(req, block_ids, num_external)``: the engine allocated blocks; when it
   accepted ``num_external`` tokens, the load is planned.
3. ``build_plan(...)`` once per step: the planned loads, plus dumps of every block that
   becomes full (all its tokens computed) in this step and is not already stored.
4. ``request_finished(req_id)``: True when dumps were planned for the request; vLLM then
   keeps its blocks until the workers report them released (``finished`` in a later
   plan asks them to).

Repair: after the step, vLLM hands the engine blocks whose load failed on any worker
(``KVConnectorOutput.invalid_block_ids``) to ``load_failed``, and recomputes every
request that holds one from its first failed block. ``load_failed`` moves those
requests' ``stored`` watermark back to that block, so the blocks vLLM recomputes are
planned as dumps again once computed, and the next request sharing the prefix hits;
the next plan names those requests (``repaired``). The KV a worker computed on top of a
failed load in that step is wrong too: each plan names the requests that start the step
on blocks loaded in it (``readers``: the loaders, and requests vLLM's prefix cache lets
share those blocks), and the worker does not dump a reader of a failed block until a plan
names it repaired (see ``worker.py``).
Where the bad copy was: a ``CORRUPT`` copy was dropped by its store when the load found
it, a ``MISSING`` one was never there, so the dump lands (stores are put-if-absent); a
``FAILED`` or ``TIMEOUT`` load says nothing against the stored copy, which is kept (the
dump then leaves it as it is).

Several KV cache groups (vLLM's hybrid KV cache manager; ``windows`` gives each group's
sliding window in tokens, None for full attention): the hit rule and the per-group
transfers are ``hybrid.py``'s. Loads are asynchronous; a failed one is reported per
request (``load_failed_requests``, vLLM's ``failed_recving``): vLLM recomputes the request
from scratch, and the request never claims the blocks of that load again.

Disaggregated prefill (``handoff.py``): ``match`` reads a consumer request's hand-off
and may answer ``None`` (not decided) while it waits for the announced blocks, at most
``pd_wait_s``; ``finish`` gives a producer's request the hand-off for its decode engine.

Observability (both off by default, and then free): with tracing on, each request has a
root span (``tracing.RequestSpans``: begun when the request is first seen, ended by
``finish`` or, when the workers still hold its blocks, by ``released``), lookups are its
child spans, and each plan carries the roots' ``traceparent`` for the workers' spans
(``StepPlan.traces``). With KV events on (``events``), every planned dump is numbered
(``Transfer.seq``) and its blocks' vLLM hashes and tokens kept until the workers report
it (``dumps_reported``); ``take_stored`` hands out the runs every rank stored (see
``events.py``).

Not thread-safe: vLLM calls the scheduler role from one thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvfabric.ucm_layer.connector.events import DumpReport, StoredBlocks, StoredRun
from kvfabric.ucm_layer.connector.handoff import Handoff, PDWait
from kvfabric.ucm_layer.connector.hybrid import NULL_BLOCK, PresentFn, group_transfers, hit_blocks
from kvfabric.ucm_layer.connector.metrics import SchedulerStats
from kvfabric.ucm_layer.connector.plan import StepPlan, Transfer
from kvfabric.ucm_layer.connector.tracing import RequestSpans, Tracer
from kvfabric.ucm_layer.connector.views import CachedReq, NewReq, ReqView

log = logging.getLogger("kvfabric.connector")

IdFn = Callable[[Sequence[bytes], np.ndarray | None], np.ndarray]


@dataclass
class _Req:
    view: ReqView
    ids: np.ndarray  # base ids of the blocks hashed so far
    block_ids: list[int] = field(default_factory=list)
    stored: int = 0  # blocks [0, stored) are known to be in the store (or planned)
    lookup_key: tuple[int, int] | None = None
    lookup_hit: int = 0  # blocks beyond `local` the store holds
    load: Transfer | None = None
    dumped_any: bool = False
    pd: PDWait = field(default_factory=PDWait)  # P/D: the wait for announced blocks
    cap: int = 1 << 62  # blocks from here on failed to load once: never claimed again
    groups: list[list[int]] = field(default_factory=list)  # per group (several groups only)
    load_start: int = 0  # the first block of the last planned load


class SchedulerSide:
    """Bookkeeping of the scheduler role (see module docstring)."""

    def __init__(
        self,
        block_size: int,
        ids_from_hashes: IdFn,
        lookup_prefix: Callable[[np.ndarray], int],
        *,
        hashes_per_block: int = 1,
        load: bool = True,
        save: bool = True,
        tracer: Tracer | None = None,
        async_load: bool = False,
        pd_wait_s: float = 30.0,
        fingerprint: str = "",
        clock: Callable[[], float] = time.monotonic,
        windows: Sequence[int | None] = (),
        lookup_present: PresentFn | None = None,
        events: StoredBlocks | None = None,
        trace_attrs: Mapping[str, Any] | None = None,
        lookup_tier: str = "",
    ) -> None:
        if block_size < 1 or hashes_per_block < 1:
            raise ValueError("block_size and hashes_per_block must be >= 1")
        self.block_size = block_size
        self.hashes_per_block = hashes_per_block
        self._ids_from_hashes = ids_from_hashes
        self._lookup_prefix = lookup_prefix
        self.can_load, self.can_save = load, save
        self.async_load = async_load
        self.pd = Handoff(fingerprint, pd_wait_s, block_size, clock)
        self.tracer = tracer or Tracer(None)
        self.spans = RequestSpans(self.tracer, trace_attrs)
        self.lookup_tier = lookup_tier
        self.events = events
        # tracing: requests finished since the last plan -> (root's traceparent, first block)
        self._finished_traces: dict[str, tuple[str, int]] = {}
        self.stats = SchedulerStats()
        self._reqs: dict[str, _Req] = {}
        self._planned_loads: list[Transfer] = []
        self._planned_async: list[Transfer] = []
        self._finished: set[str] = set()
        self._repaired: set[str] = set()
        self._store_down = False
        self.windows = tuple(windows)
        self.multi = len(self.windows) > 1
        if self.multi and lookup_present is None:
            raise ValueError("several KV cache groups need lookup_present")
        self._lookup_present = lookup_present
        if self.multi:
            self.async_load = True  # request-level load failures exist only for async loads

    @property
    def fingerprint(self) -> str:
        """Names the block ids in P/D hand-offs (see ``handoff.py``)."""
        return self.pd.fingerprint

    # ------------------------------------------------------------------ ids
    def _state(self, view: ReqView) -> _Req:
        st = self._reqs.get(view.req_id)
        if st is None:
            st = self._reqs[view.req_id] = _Req(view, np.zeros((0, 16), np.uint8))
            if self.spans.enabled:
                self.spans.begin(view.req_id, view.num_tokens)
        else:
            st.view = view
        return st

    def _ids(self, st: _Req, upto: int) -> np.ndarray:
        """Base ids of the first ``upto`` blocks (fewer if the engine has not hashed them)."""
        have = st.ids.shape[0]
        if have < upto:
            k = self.hashes_per_block
            hashes = st.view.block_hashes[have * k : upto * k]
            hashes = hashes[k - 1 :: k] if k > 1 else hashes
            if hashes:
                parent = st.ids[-1] if have else None
                new = self._ids_from_hashes(hashes, parent)
                st.ids = np.concatenate([st.ids, new]) if have else new
        return st.ids[:upto]

    # ------------------------------------------------------------------ lookup
    def match(self, view: ReqView, local_tokens: int) -> tuple[int | None, bool]:
        """vLLM's ``get_num_new_matched_tokens``: the tokens beyond ``local_tokens`` the store
        holds, and whether they load asynchronously. ``None``: not decided yet (a P/D
        consumer waiting for the blocks its producer announced); vLLM asks again next step."""
        if not self.can_load:
            return 0, False
        st = self._state(view)
        self.pd.announce(st.pd, view)
        hit = self.num_new_matched_tokens(view, local_tokens, fresh=st.pd.announced > 0)
        if not self.pd.settle(st.pd, view.req_id, local_tokens // self.block_size + st.lookup_hit):
            return None, False
        return hit, bool(hit and self.async_load)

    def num_new_matched_tokens(self, view: ReqView, local_tokens: int, fresh: bool = False) -> int:
        """The tokens beyond ``local_tokens`` the store holds (see the module docstring);
        ``fresh`` asks the store again even for a repeated question (a P/D wait)."""
        if not self.can_load:
            return 0
        st = self._state(view)
        bs = self.block_size
        local = local_tokens // bs
        claimable = max(view.num_tokens - 1, 0) // bs  # never the last token
        key = (local, claimable)
        if st.lookup_key == key and not fresh:
            return st.lookup_hit * bs
        if fresh and st.lookup_key == key and self.pd.throttled(st.pd):
            return st.lookup_hit * bs  # a waiting consumer asks the store at most every 5 ms
        self.pd.asked(st.pd)
        hit = 0
        ids = self._ids(st, claimable)
        if ids.shape[0] > local:
            try:
                start_ns = time.time_ns() if self.spans.enabled else 0
                if self.multi:
                    hit = hit_blocks(
                        ids[local:], local, st.cap - local, self.windows, bs, self._lookup_present
                    )
                else:
                    hit = int(self._lookup_prefix(ids[local:]))
                if self.spans.enabled:
                    self.spans.lookup(
                        view.req_id,
                        start_ns,
                        time.time_ns(),
                        requested_tokens=view.num_tokens,
                        hit_tokens=(local + hit) * bs,
                        hit_rate=(local + hit) * bs / max(view.num_tokens, 1),
                        store_tier=self.lookup_tier,
                    )
                if self._store_down:
                    log.warning("kvfabric: the store answers lookups again")
                    self._store_down = False
            except Exception as e:  # noqa: BLE001 - a store that does not answer is a miss
                if not self._store_down:
                    log.warning(
                        "kvfabric: store lookup failed (%s: %s); treating lookups as misses until it answers",
                        type(e).__name__,
                        e,
                    )
                    self._store_down = True
                hit = 0
        hit = max(0, min(hit, ids.shape[0] - local, st.cap - local))
        st.lookup_key, st.lookup_hit = key, hit
        if not fresh or not self.pd.waiting(st.pd):
            self.stats.lookup(
                view.num_tokens, (local + hit) * bs, hit * bs, max(0, ids.shape[0] - local), ids.shape[0]
            )
        return hit * bs

    def after_alloc(
        self,
        view: ReqView,
        block_ids: Sequence[int],
        num_external_tokens: int,
        groups: Sequence[Sequence[int]] = (),
    ) -> None:
        st = self._state(view)
        st.block_ids = list(block_ids)
        if self.multi:
            st.groups = [list(g) for g in groups]
            if len(st.groups) != len(self.windows):
                raise ValueError(
                    f"request {view.req_id}: block ids of {len(st.groups)} KV cache groups, "
                    f"the engine has {len(self.windows)}"
                )
            st.block_ids = st.groups[0]
        if num_external_tokens <= 0:
            return
        bs = self.block_size
        n = num_external_tokens // bs
        if st.lookup_key is None or n > st.lookup_hit:
            raise ValueError(
                f"request {view.req_id}: the engine accepted {num_external_tokens} external tokens, "
                f"more than the {st.lookup_hit * bs} the last lookup found"
            )
        local = st.lookup_key[0]
        ids = self._ids(st, local + n)[local:]
        if self.multi:
            self._plan_group_loads(st, view, ids, local, n)
            return
        blocks = np.asarray(st.block_ids[local : local + n], np.int64)
        if blocks.size != n:
            raise ValueError(f"request {view.req_id}: {blocks.size} blocks allocated for {n} loaded blocks")
        st.load = Transfer(view.req_id, ids, blocks, view.num_tokens, bs)
        st.stored = max(st.stored, local + n)
        (self._planned_async if self.async_load else self._planned_loads).append(st.load)

    def _plan_group_loads(self, st: _Req, view: ReqView, ids: np.ndarray, local: int, n: int) -> None:
        """Several groups: an async load per group into the non-null blocks vLLM allocated
        for ``[local, local + n)`` (at least one transfer, so vLLM hears the request end)."""
        for g, row in enumerate(st.groups):
            if len(row) < local + n:
                raise ValueError(
                    f"request {view.req_id}: group {g} has {len(row)} blocks for {local + n} loaded blocks"
                )
        rows = [np.asarray(row[local : local + n], np.int64) for row in st.groups]
        loads = group_transfers(
            view.req_id, ids, rows, view.num_tokens, self.block_size, self.windows, dump=False
        )
        if not loads:
            empty = np.zeros(0, np.int64)
            loads.append(Transfer(view.req_id, ids[:0], empty, view.num_tokens, self.block_size))
        st.load = loads[0]
        st.load_start = local
        st.stored = max(st.stored, local + n)
        self._planned_async.extend(loads)

    # ------------------------------------------------------------------ per step
    def build_plan(
        self,
        new: Sequence[NewReq],
        cached: Sequence[CachedReq],
        num_scheduled: dict[str, int],
        preempted: set[str] | None = None,
    ) -> StepPlan:
        plan = StepPlan(
            loads=self._planned_loads,
            async_loads=self._planned_async,
            finished=self._finished,
            preempted=set(preempted or ()),
            repaired=self._repaired,
            idle=not any(num_scheduled.values()),
        )
        self._planned_loads, self._planned_async = [], []
        self._finished, self._repaired = set(), set()
        loading = {int(b) for t in plan.loads for b in t.blocks.tolist()}
        for r in new:
            st = self._reqs.get(r.req_id)
            if st is None:
                continue
            st.block_ids = list(r.block_ids)
            if self.multi:
                st.groups = [list(g) for g in r.groups]
                st.block_ids = st.groups[0] if st.groups else st.block_ids
            if loading:
                self._note_reader(
                    plan, r.req_id, st.block_ids[: r.num_computed_tokens // self.block_size], loading
                )
            # computed tokens count vLLM's own prefix-cache hits (stored when first
            # computed) and the blocks loaded from the store this step
            st.stored = max(st.stored, r.num_computed_tokens // self.block_size)
            self._plan_dumps(st, r.num_computed_tokens + num_scheduled.get(r.req_id, 0), plan)
            st.load = None
        for c in cached:
            st = self._reqs.get(c.req_id)
            if st is None:
                continue
            if self.multi:
                if c.resumed:
                    st.groups = [list(g) for g in c.new_groups] or [[] for _ in self.windows]
                    st.stored = c.num_computed_tokens // self.block_size
                else:
                    for row, new_ids in zip(st.groups, c.new_groups, strict=False):
                        row.extend(new_ids)
                st.block_ids = st.groups[0] if st.groups else []
                st.load = None
                self._plan_dumps(st, c.num_computed_tokens + num_scheduled.get(c.req_id, 0), plan)
                continue
            if c.resumed:  # a preempted request starts over with a new block table
                st.block_ids = list(c.new_block_ids or [])
                st.stored = c.num_computed_tokens // self.block_size
                if loading:
                    self._note_reader(plan, c.req_id, st.block_ids[: st.stored], loading)
                st.load = None
            elif c.new_block_ids:
                st.block_ids.extend(c.new_block_ids)
            self._plan_dumps(st, c.num_computed_tokens + num_scheduled.get(c.req_id, 0), plan)
        if self.spans.enabled:
            self._trace_plan(plan)
        return plan

    def _trace_plan(self, plan: StepPlan) -> None:
        """The roots' ``traceparent`` of every request the plan names (tracing on)."""
        for t in (*plan.loads, *plan.async_loads, *plan.dumps):
            if t.req_id not in plan.traces:
                plan.traces[t.req_id] = self.spans.traceparent(t.req_id)
        for r, (parent, first) in self._finished_traces.items():
            plan.traces[r] = parent
            if first >= 0:
                plan.first_blocks[r] = first
        self._finished_traces.clear()

    @staticmethod
    def _note_reader(plan: StepPlan, req_id: str, prefix: list[int], loading: set[int]) -> None:
        """A request that starts this step on blocks loaded this step (its own, or another
        request's that vLLM's prefix cache shares): its KV this step depends on that load."""
        reads = loading.intersection(prefix)
        if reads:
            plan.readers[req_id] = reads

    def _plan_dumps(self, st: _Req, computed_after_step: int, plan: StepPlan) -> None:
        if not self.can_save:
            return
        if self.multi:
            self._plan_group_dumps(st, computed_after_step, plan)
            return
        found = self._newly_full(st, computed_after_step, len(st.block_ids))
        if found is None:
            return
        ids, rows = found
        full = rows.stop
        t = Transfer(
            st.view.req_id,
            ids[rows],
            np.asarray(st.block_ids[rows], np.int64),
            st.view.num_tokens,
            self.block_size,
        )
        if self.events is not None:
            self._number(st, t, np.arange(rows.start, rows.stop))
        plan.dumps.append(t)
        st.stored = full
        st.dumped_any = True

    def _newly_full(
        self, st: _Req, computed_after_step: int, allocated: int
    ) -> tuple[np.ndarray, slice] | None:
        """The ids of the request's blocks so far and the rows of those that become full in
        this step and are not stored yet (None: none), within the ``allocated`` blocks."""
        full = min(computed_after_step // self.block_size, allocated)
        if full <= st.stored:
            return None
        ids = self._ids(st, full)
        full = min(full, ids.shape[0])
        return None if full <= st.stored else (ids, slice(st.stored, full))

    def _plan_group_dumps(self, st: _Req, computed_after_step: int, plan: StepPlan) -> None:
        """Several groups: a dump per group of the blocks that became full, but null ones."""
        found = self._newly_full(st, computed_after_step, min(len(row) for row in st.groups))
        if found is None:
            return
        ids, rows = found
        dumps = group_transfers(
            st.view.req_id,
            ids[rows],
            [np.asarray(row[rows], np.int64) for row in st.groups],
            st.view.num_tokens,
            self.block_size,
            self.windows,
            dump=True,
        )
        if self.events is not None:
            index = np.arange(rows.start, rows.stop)
            for t in dumps:
                self._number(st, t, index[np.asarray(st.groups[t.group][rows], np.int64) != NULL_BLOCK])
        plan.dumps.extend(dumps)
        st.dumped_any = st.dumped_any or bool(dumps)
        st.stored = rows.stop

    def _number(self, st: _Req, t: Transfer, index: np.ndarray) -> None:
        """KV events: number the dump ``t`` of the request's blocks ``index`` and keep their
        vLLM hashes, parents and tokens until the workers report it."""
        assert self.events is not None
        k, bs, view = self.hashes_per_block, self.block_size, st.view
        hashes = [view.block_hashes[(b + 1) * k - 1] for b in index.tolist()]
        parents = [view.block_hashes[b * k - 1] if b else None for b in index.tolist()]
        tokens = [view.token_ids[b * bs : (b + 1) * bs] for b in index.tolist()]
        t.seq = self.events.next_seq()
        self.events.planned(t.seq, index, hashes, parents, tokens, bs, t.group, view.lora_id, view.lora_name)

    def dumps_reported(self, reports: Iterable[DumpReport]) -> None:
        """KV events: the workers' reports of numbered dumps (``update_connector_output``)."""
        if self.events is not None:
            self.events.report(reports)

    def take_stored(self) -> list[StoredRun]:
        """KV events: the runs of blocks every rank stored since the last call."""
        return self.events.take() if self.events is not None else []

    def released(self, req_ids: Collection[str] | None) -> None:
        """vLLM's ``finished_sending``: these requests' dumps released their blocks on every
        worker (their root spans end)."""
        if self.spans.enabled and req_ids:
            self.spans.released(req_ids)

    def load_failed_requests(self, req_ids: Collection[str]) -> int:
        """Several groups: requests whose asynchronous load failed (vLLM's
        ``failed_recving``; it recomputes them from scratch). Each forgets that the blocks
        of that load are stored (so they are dumped again once recomputed) and never claims
        them again (the store may still list them); it is named ``repaired`` in the next
        plan. Returns the number of blocks set back (counted as ``repair_blocks``)."""
        total = 0
        for r in req_ids:
            st = self._reqs.get(r)
            if st is None:
                continue
            st.cap, st.lookup_key = min(st.cap, st.load_start), None
            total += max(st.stored - st.load_start, 0)
            st.stored = min(st.stored, st.load_start)
            self._repaired.add(r)
        if total:
            self.stats.add(repair_blocks=total)
        return total

    def load_failed(self, block_ids: Collection[int]) -> int:
        """Engine blocks whose load failed in a past step (vLLM's ``invalid_block_ids``):
        every tracked request whose stored prefix holds one is named ``repaired`` in the
        next plan and forgets that its blocks from the first failed one on are stored, so
        they are dumped again once recomputed. Like vLLM, a failed block that several
        requests share (its prefix cache) is recomputed by the first of them only: the
        others are set back only to their first block that request does not hold (their
        own blocks after it, whose dumps the workers skipped), so none of them dumps a
        shared block before it is recomputed. Returns the number of blocks set back (also
        counted as ``repair_blocks``)."""
        bad = set(block_ids)
        if not bad:
            return 0
        total = 0
        claimed: set[int] = set()  # failed blocks a request set back will recompute
        recomputing: set[int] = set()  # the blocks of those requests
        for st in self._reqs.values():
            held = [i for i, b in enumerate(st.block_ids[: st.stored]) if b in bad]
            if not held:
                continue
            # an async load that failed sends the request back to vLLM's lookup: it must
            # not claim the failed blocks again (the store may still list them)
            st.cap, st.lookup_key = min(st.cap, held[0]), None
            self._repaired.add(st.view.req_id)
            mine = [i for i in held if st.block_ids[i] not in claimed]
            if mine:
                first = mine[0]
                claimed.update(st.block_ids[i] for i in held)
                recomputing.update(st.block_ids)
            else:
                tail = range(held[0], st.stored)
                first = next((i for i in tail if st.block_ids[i] not in recomputing), st.stored)
            total += st.stored - first
            st.stored = first
        if total:
            self.stats.add(repair_blocks=total)
        return total

    def request_finished(self, req_id: str) -> bool:
        """Whether vLLM must keep the request's blocks until the workers release them."""
        st = self._reqs.pop(req_id, None)
        if st is None or not st.dumped_any:
            return False
        self._finished.add(req_id)
        return True

    def finish(self, req_id: str, params: Mapping[str, Any] | None) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's ``request_finished``: whether to keep the blocks (``request_finished``) and,
        for a prefill asked to hand off (``do_remote_decode`` in its ``kv_transfer_params``),
        the parameters for its decode engine: ``do_remote_prefill`` and, under ``kvfabric``,
        how many full blocks were planned as dumps and the fingerprint of their ids (the
        consumer waits for them, see ``match``)."""
        st = self._reqs.get(req_id)
        stored = st.stored if st is not None else 0
        keep = self.request_finished(req_id)
        if self.spans.enabled:
            first = int(st.block_ids[0]) if st is not None and st.block_ids else -1
            self._finished_traces[req_id] = (self.spans.traceparent(req_id), first)
            self.spans.set(req_id, stored_blocks=stored if self.can_save else 0)
            self.spans.finish(req_id, keep)
        return keep, self.pd.params(params, stored if self.can_save else 0)

    def forget(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)
        self.spans.forget(req_id)

    @property
    def num_tracked(self) -> int:
        return len(self._reqs)
