"""The worker role: move the planned blocks between the KV cache and the store.

Call order per engine step (vLLM's model runner drives it):

1. ``register(kv_caches, ...)`` once: the KV tensors become a :class:`KVLayout`, their
   memory is made addressable on the platform, the store and the Delegator are built.
   When the connector derived the physical layout the block ids cover
   (``expected_layout``, a :attr:`KVLayout.signature`), the tensors must have exactly it:
   a worker handed other tensors raises ``ValueError`` naming both, before it touches
   the store (its blocks would carry ids that promise another byte layout).
2. ``start_load(plan)`` before the forward (after it when the step has no synchronous
   load). ``plan.async_loads`` are issued and left running, tracked by ``loads.py``
   (deadlines ``load_timeout_s``, the stall hold ``STALL_HOLD_S``, the idle wait
   ``IDLE_WAIT_S``): ``finished_loads()`` (called after every step, forward or not)
   reports each request whose load ended, after scattering its good blocks and
   recording its failed ones (a load past its deadline is cancelled, its unfinished
   blocks fail as ``TIMEOUT``). Failed blocks are handed to vLLM no later than the step
   that reports the request (vLLM's contract).
   Synchronous loads: whole-request mode loads every planned block and returns when
   the bytes are in place; layer-wise mode issues one load per
   layer and ``wait_layer(name)`` (called by each attention layer) waits for its own.
   A block that fails to load (store gone, timeout, missing) is remembered;
   ``failed_blocks()`` hands those to vLLM, which recomputes them. The first failure of
   a run of failures is logged once as a warning, never raised; every failed block is
   counted in ``load_failed_blocks`` and under its reason (``load_failed_<status>``, see
   ``metrics.py``). The KV the forward computes on top of the failed blocks is wrong as
   well: the dumps of every request that read them (``plan.readers``) are skipped from
   then on, until a plan names it ``repaired`` (the scheduler set it back; vLLM
   recomputes it from the failed block, and those dumps are good again).
3. ``save_layer(name)`` after each attention layer (layer-wise mode) and
   ``wait_for_save(plan)`` after the forward: dumps start asynchronously (gather on the
   copy stream, then the store transfer).
4. ``finished(ids)``: the requests of earlier ``plan.finished`` whose dumps released
   their source blocks, for vLLM to free. ``preempted(ids)`` waits for such dumps before
   vLLM reuses a preempted request's blocks.

Waits on a dump's source blocks (``preempted``; ``transient`` dumps, below) last at most
``load_timeout_s``: a dump still holding them then is cancelled (the store's cancel
guarantees it reads them no more) and its unfinished blocks fail as ``TIMEOUT``, a
future miss; nothing hangs. A failed dump is logged once (until dumps succeed again)
with the store's per-block reasons (``2 timeout, 1 failed``) and counted in
``save_failed_blocks``.

Several KV cache groups (``groups``: each group's layer names, vLLM's hybrid manager):
each group gets its own :class:`KVLayout` (``hybrid.group_layouts``), store and Delegator
over its layers (views of one allocation: memory is made addressable once), and a
transfer goes to its group's, with the group stamped into its ids. Such engines load
asynchronously only: a request whose load failed in any group is reported by
``failed_loads()`` (with ``finished_loads()``), and ``failed_blocks()`` stays empty (vLLM
takes no block-level failures there). Dumps of ``transient`` transfers (sliding-window
blocks, which vLLM frees while the request runs) are waited on until they released their
source blocks before ``wait_for_save`` returns. Layer-wise mode is refused by the
connector.

Observability (off by default, and then free): with tracing on, loads, dumps and (with a
sparse backend in the process) each finished request's sparse selection become spans under
the request's root span, whose ``traceparent`` the plans carry (``plan.traces``; see
``tracing.py``). With KV events on (``report_dumps``), every numbered dump
(``Transfer.seq``) is reported once the store answered for all its layers: which of its
blocks this rank stored (``take_reports``, see ``events.py``); a dump skipped because its
KV was computed on a failed load is reported as not stored. Tracking those needs every
dump's statuses, so a dump is then settled even after vLLM freed its request. That
bookkeeping (the root contexts, the tiers, the dump batches and reports) is
``transfer_notes.py``'s; this module moves the bytes and tells it what happened.

Ranks: a worker stamps its TP rank into the ids (each rank stores its own heads). MLA:
every rank holds the same latent KV, so all use rank 0's ids and only rank 0 dumps.
Not thread-safe beyond what vLLM does (one thread per worker).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from kvfabric.platform.base import Platform
from kvfabric.platform.stream import Event
from kvfabric.platform.types import Medium
from kvfabric.status import wait_or_cancel
from kvfabric.ucm_layer import hashing
from kvfabric.ucm_layer.connector.config import ConnectorConfig
from kvfabric.ucm_layer.connector.events import DumpReport
from kvfabric.ucm_layer.connector.hybrid import group_layouts
from kvfabric.ucm_layer.connector.loads import IDLE_WAIT_S as IDLE_WAIT_S
from kvfabric.ucm_layer.connector.loads import STALL_HOLD_S, AsyncLoads, LoadEnd
from kvfabric.ucm_layer.connector.metrics import StatsWindow, describe_reasons, failure_reasons
from kvfabric.ucm_layer.connector.plan import StepPlan, Transfer
from kvfabric.ucm_layer.connector.repair import LoadFailures
from kvfabric.ucm_layer.connector.tracing import Tracer
from kvfabric.ucm_layer.connector.transfer_notes import DumpBatch, TransferNotes
from kvfabric.ucm_layer.delegator import Delegator, DumpOp, LoadOp
from kvfabric.ucm_layer.kv_layout import KVLayout, layout_from_tensors
from kvfabric.ucm_layer.store.base import BlockStatus, Store, StoreLayout

log = logging.getLogger("kvfabric.connector")

StoreFactory = Callable[[StoreLayout], Store]


def _raw_storage(t: Any) -> Any:
    """A contiguous byte tensor over the whole storage behind ``t`` (to wrap it once)."""
    import torch

    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


class WorkerSide:
    """Bookkeeping and data movement of the worker role (see module docstring)."""

    def __init__(
        self,
        cfg: ConnectorConfig,
        platform: Platform,
        store_factory: StoreFactory,
        *,
        rank: int = 0,
        mla: bool = False,
        load: bool = True,
        save: bool = True,
        tracer: Tracer | None = None,
        compute_done: Callable[[], Event | None] | None = None,
        expected_layout: str | None = None,
        layout_note: str = "",
        groups: tuple[tuple[str, ...], ...] = (),
        report_dumps: bool = False,
        dump_tier: str = "",
    ) -> None:
        self.cfg, self.platform = cfg, platform
        self.expected_layout, self._layout_note = expected_layout, layout_note
        self._store_factory = store_factory
        self.rank, self.mla = rank, mla
        self.can_load, self.can_save = load, save and (rank == 0 or not mla)
        self._compute_done = compute_done or (lambda: None)
        self.stats = StatsWindow()
        self.layout: KVLayout | None = None
        self.store: Store | None = None
        self.delegator: Delegator | None = None
        self.groups = tuple(groups) if len(groups) > 1 else ()
        self.stores: list[Store] = []  # one per KV cache group (the same store when alike)
        self.delegators: list[Delegator] = []  # one per KV cache group
        self._wrapped: list[Any] = []
        self._layer_index: dict[str, int] = {}
        self._layer_loads: dict[int, tuple[LoadOp, np.ndarray, float]] = {}
        self._layer_dump_rows: tuple[np.ndarray, np.ndarray, list[Transfer]] | None = None
        self._dumps: dict[str, list[DumpOp]] = {}
        self._awaiting: set[str] = set()
        self._async = AsyncLoads(cfg.load_timeout_s, self._tag, multi_group=bool(self.groups))
        self._failures = LoadFailures()
        self._load_trouble = False
        self._save_trouble = False
        self.notes = TransferNotes(tracer, rank, report_dumps, dump_tier or cfg.store)
        self._unsettled: list[DumpOp] = []  # dumps spans or reports still wait for
        if cfg.sparse:
            log.info(
                "kvfabric: sparse attention %r runs in kvfabric's attention backend "
                "(budget and thresholds: additional_config['kvfabric_sparse'], docs/sparse.md)",
                cfg.sparse,
            )

    @property
    def tracer(self) -> Tracer:
        """The spans' tracer (``notes.tracer``)."""
        return self.notes.tracer

    @tracer.setter
    def tracer(self, tracer: Tracer) -> None:
        self.notes.tracer = tracer

    @property
    def report_dumps(self) -> bool:
        """Whether numbered dumps are reported for KV events (``notes.report_dumps``)."""
        return self.notes.report_dumps

    @report_dumps.setter
    def report_dumps(self, on: bool) -> None:
        self.notes.report_dumps = on

    @property
    def dump_tier(self) -> str:
        """The tier a dump's success speaks for (``notes.dump_tier``)."""
        return self.notes.dump_tier

    # ------------------------------------------------------------------ setup
    def register(
        self, kv_caches: Mapping[str, Any], num_blocks: int, block_strides: Mapping[str, int] | None = None
    ) -> KVLayout:
        if self.layout is not None:
            raise ValueError("register was already called for this worker")
        if self.groups:
            layout, layouts = group_layouts(kv_caches, self.groups, num_blocks, block_strides)
        else:
            layout = layout_from_tensors(kv_caches, num_blocks, block_strides)
            layouts = [layout]
        self._check_layout(layout)
        seen: set[int] = set()
        on_host = True
        for value in kv_caches.values():
            for t in value if isinstance(value, (tuple, list)) else [value]:
                ptr = int(t.untyped_storage().data_ptr())
                if ptr in seen:
                    continue
                seen.add(ptr)
                raw = _raw_storage(t)
                on_host = on_host and raw.device.type == "cpu"
                medium = (
                    Medium.HBM if (raw.device.type != "cpu" or self.platform.name == "sim") else Medium.DRAM
                )
                self._wrapped.append(self.platform.wrap(raw, medium))
        self.cfg = self.cfg.resolved(on_host)  # the connector resolved it already; direct users too
        for part in layouts:
            store = self._store_factory(
                Delegator.store_layout(part, bool(self.cfg.delegator), self.cfg.layerwise)
            )
            self.stores.append(store)
            self.delegators.append(
                Delegator(
                    self.platform,
                    part,
                    store,
                    enabled=bool(self.cfg.delegator),
                    layerwise=self.cfg.layerwise,
                    staging_blocks=self.cfg.staging_blocks,
                )
            )
        self.store, self.delegator = self.stores[0], self.delegators[0]
        self._layer_index = {name: i for i, name in enumerate(layout.layer_names)}
        self.layout = layout
        log.info(
            "kvfabric worker rank %d: %d layers, %d pieces/block, %d B/block, %d blocks, store %s%s",
            self.rank,
            layout.num_layers,
            layout.pieces,
            layout.block_bytes,
            num_blocks,
            self.cfg.store,
            " (MLA: rank 0 dumps)" if self.mla else "",
        )
        return layout

    def _check_layout(self, layout: KVLayout) -> None:
        if self.expected_layout is None:
            if self._layout_note:
                log.warning(
                    "kvfabric worker rank %d: the block ids do not cover the physical KV layout (%s); "
                    "engines sharing this store must lay out their KV caches alike (this one: %s)",
                    self.rank,
                    self._layout_note,
                    layout.signature,
                )
            return
        if layout.signature != self.expected_layout:
            raise ValueError(
                f"kvfabric: the KV cache tensors vLLM handed worker rank {self.rank} are laid out as "
                f"{layout.signature!r} ({layout.description}), but the block ids were derived for "
                f"{self.expected_layout!r} (KV cache layout {self._layout_note}); their blocks would "
                "be named for bytes they do not hold. Check VLLM_KV_CACHE_LAYOUT and the attention "
                "backend, or report this vLLM version."
            )

    def _tag(self, ids: np.ndarray, group: int = 0) -> np.ndarray:
        return hashing.tag(ids, 0 if self.mla else self.rank, group)

    def _group_delegator(self, group: int) -> Delegator | None:
        return self.delegators[group] if group < len(self.delegators) else None

    @staticmethod
    def _join(items: list[Transfer]) -> tuple[np.ndarray, np.ndarray]:
        if not items:
            return np.zeros((0, 16), np.uint8), np.zeros(0, np.int64)
        return np.concatenate([t.ids for t in items]), np.concatenate([t.blocks for t in items])

    # ------------------------------------------------------------------ loads
    def start_load(self, plan: StepPlan) -> None:
        self.notes.note(plan)
        self._layer_loads.clear()
        self._failures.begin(plan)
        self._async.begin(plan.idle)
        for t in plan.async_loads:
            self._start_async(t)
        if not plan.loads or self.delegator is None or not self.can_load:
            return
        ids, blocks = self._join(plan.loads)
        ids = self._tag(ids)
        t0 = time.perf_counter()
        if self.cfg.layerwise:
            for layer in range(self.delegator.layout.num_layers):
                try:
                    op = self.delegator.load(ids, blocks, layer=layer)
                except Exception as e:  # noqa: BLE001 - a failed load is a recompute
                    self._load_failed(blocks, f"{type(e).__name__}: {e}")
                    return
                self._layer_loads[layer] = (op, blocks, t0)
            return
        start_ns = time.time_ns()
        tiers = self.notes.load_tiers(self.store, ids, plan.loads)
        try:
            status = wait_or_cancel(self.delegator.load(ids, blocks), self.cfg.load_timeout_s)
        except Exception as e:  # noqa: BLE001 - a failed load is a recompute
            self._load_failed(blocks, f"{type(e).__name__}: {e}")
            return
        self._load_done(blocks, status, time.perf_counter() - t0, self.delegator.layout.block_bytes)
        self.notes.load_spans(plan.loads, status, start_ns, self.delegator.layout.block_bytes, tiers)

    def _start_async(self, t: Transfer) -> None:
        delegator = self._group_delegator(t.group)
        if self.groups and t.blocks.size == 0:  # nothing of this group to load
            self._async.ended(t.req_id)
            return
        if delegator is None or not self.can_load:
            self._load_failed(t.blocks, "the worker has no store to load from", req_id=t.req_id)
            self._async.ended(t.req_id)
            return
        t, held = self._async.hold(t)
        if held.blocks.size:
            self._load_failed(
                held.blocks,
                f"{held.blocks.size} blocks from one whose load timed out within {STALL_HOLD_S:g} s",
                np.full(held.blocks.size, BlockStatus.TIMEOUT, np.int8),
                req_id=t.req_id,
            )
        if t.blocks.size == 0:
            self._async.ended(t.req_id)
            return
        tagged = self._tag(t.ids, t.group)
        self.notes.load_issued(t, self.stores[t.group] if t.group < len(self.stores) else None, tagged)
        try:
            op = delegator.load(tagged, t.blocks)
        except Exception as e:  # noqa: BLE001 - a failed load is a recompute
            self._load_failed(t.blocks, f"{type(e).__name__}: {e}", req_id=t.req_id)
            self._async.ended(t.req_id)
            return
        self._async.track(t, op)

    def finished_loads(self) -> set[str]:
        """Requests whose asynchronous load ended (well or not, in every group) since the
        last call; their failed blocks are in ``failed_blocks()`` from now on (several
        groups: the requests are in ``failed_loads()``)."""
        done, ends = self._async.collect()
        for end in ends:
            self._load_ended(end)
        return done

    def _load_ended(self, end: LoadEnd) -> None:
        t = end.transfer
        tier = self.notes.load_tier(t)
        if end.status is None:
            self._load_failed(t.blocks, end.error, req_id=t.req_id)
            return
        delegator = self._group_delegator(t.group)
        assert delegator is not None
        self._load_done(t.blocks, end.status, end.secs, delegator.layout.block_bytes, req_id=t.req_id)
        if self.delegator is not None:
            self.notes.load_spans([t], end.status, end.start_ns, self.delegator.layout.block_bytes, [tier])

    def failed_loads(self) -> set[str]:
        """Several groups: requests whose asynchronous load failed in some group, reported
        by ``finished_loads()`` (for vLLM's ``failed_recving``); each once."""
        return self._async.failed_requests()

    @property
    def loading(self) -> int:
        """Asynchronous loads in flight."""
        return len(self._async)

    def wait_layer(self, layer_name: str) -> None:
        layer = self._layer_index.get(layer_name)
        entry = self._layer_loads.pop(layer, None) if layer is not None else None
        if entry is None:
            return
        op, blocks, t0 = entry
        try:
            status = wait_or_cancel(op, self.cfg.load_timeout_s)
        except Exception as e:  # noqa: BLE001 - a failed load is a recompute
            self._load_failed(blocks, f"{type(e).__name__}: {e}")
            return
        assert self.delegator is not None
        self._load_done(
            blocks, status, time.perf_counter() - t0, self.delegator.layout.layer_bytes(layer), layer
        )

    def _load_done(
        self,
        blocks: np.ndarray,
        status: np.ndarray,
        secs: float,
        block_bytes: int,
        layer: int | None = None,
        req_id: str | None = None,
    ) -> None:
        ok = status == BlockStatus.OK
        if not ok.all():
            self._load_failed(
                blocks[~ok], f"{int((~ok).sum())} of {blocks.size} blocks", status[~ok], req_id=req_id
            )
        elif self._load_trouble:
            log.warning("kvfabric: loads from the store succeed again")
            self._load_trouble = False
        n = int(ok.sum())
        if layer in (None, 0):  # a block counts once, however many layers it arrives in
            self.stats.add(loaded_blocks=n)
        self.stats.add(loaded_bytes=n * block_bytes, load_s=secs)

    def _load_failed(
        self, blocks: np.ndarray, why: str, status: np.ndarray | None = None, req_id: str | None = None
    ) -> None:
        """Remember ``blocks`` for vLLM to recompute and count them, by reason: their store
        ``status`` (None: the load raised, reason ``error``). A block that fails in several
        layers of one step counts once. Several groups: ``req_id``'s load failed."""
        if req_id is not None:
            self._async.failed(req_id)
        reasons = self._failures.record(blocks, status)
        self.stats.add(load_failed_blocks=sum(reasons.values()), **reasons)
        if not self._load_trouble:
            log.warning(
                "kvfabric: loading KV blocks from the store %r failed (%s: %s); vLLM recomputes them "
                "(kv_load_failure_policy='recompute'). Further failures are counted, not logged.",
                self.cfg.store,
                why,
                ", ".join(f"{n} {k.removeprefix('load_failed_')}" for k, n in reasons.items()) or "again",
            )
            self._load_trouble = True

    def failed_blocks(self) -> set[int]:
        """Blocks whose load failed since the last call; empty with several groups (their
        failures are per request, ``failed_loads``)."""
        out = self._failures.take()
        return set() if self.groups else out

    # ------------------------------------------------------------------ saves
    def save_layer(self, layer_name: str, plan: StepPlan | None) -> None:
        if not self.cfg.layerwise or plan is None or not plan.dumps or not self.can_save:
            return
        self.notes.note(plan)
        layer = self._layer_index.get(layer_name)
        self._failures.begin(plan)
        items = self._failures.dumpable(plan.dumps)
        if layer is None or self.delegator is None or not items:
            return
        if self._layer_dump_rows is None or self._layer_dump_rows[2] is not items:
            ids, blocks = self._join(items)
            self._layer_dump_rows = (self._tag(ids), blocks, items)
        ids, blocks, items = self._layer_dump_rows
        self._start_dumps(items, ids, blocks, layer)

    def wait_for_save(self, plan: StepPlan | None) -> None:
        self._layer_dump_rows = None
        self.notes.new_step()
        if plan is None:
            return
        self.notes.note(plan)
        self._failures.begin(plan)
        items = self._failures.dumpable(plan.dumps)
        if self.can_save:
            self.notes.not_dumped(plan.dumps, items)
        self.notes.requests_done(plan, self._dumps)
        if items and self.groups and self.can_save and self.delegators:
            self._start_group_dumps(items)
        elif items and not self.cfg.layerwise and self.can_save and self.delegator is not None:
            ids, blocks = self._join(items)
            self._start_dumps(items, self._tag(ids), blocks, None)
        self._awaiting |= plan.finished
        if plan.preempted:
            self.preempted(plan.preempted)

    def _start_group_dumps(self, items: list[Transfer]) -> None:
        """Several groups: one dump per group; those of transient blocks (sliding windows)
        have released their source blocks when this returns."""
        transient: list[DumpOp] = []
        for g, delegator in enumerate(self.delegators):
            mine = [t for t in items if t.group == g]
            if not mine:
                continue
            ids, blocks = self._join(mine)
            op = self._start_dumps(mine, self._tag(ids, g), blocks, None, delegator)
            if op is not None and any(t.transient for t in mine):
                transient.append(op)
        for op in transient:
            self._await_release(op)

    def _start_dumps(
        self,
        items: list[Transfer],
        ids: np.ndarray,
        blocks: np.ndarray,
        layer: int | None,
        delegator: Delegator | None = None,
    ) -> DumpOp | None:
        delegator = delegator or self.delegator
        assert delegator is not None
        batch = (
            self.notes.dump_batch(
                items, blocks, layer, delegator.layout.num_layers, delegator.layout.block_bytes
            )
            if self.notes.tracking
            else None
        )
        try:
            op = delegator.dump(ids, blocks, after=self._compute_done(), layer=layer)
        except Exception as e:  # noqa: BLE001 - a failed dump is a future miss
            self._save_failed(int(blocks.size), f"{type(e).__name__}: {e}")
            if batch is not None:
                self.notes.batch_settled(batch, None)
            return None
        op.started = time.perf_counter()  # type: ignore[attr-defined]
        op.block_bytes = delegator.layout.block_bytes  # type: ignore[attr-defined]
        if batch is not None:
            op.batch = batch  # type: ignore[attr-defined]
            self._unsettled.append(op)
        for t in items:  # every request of the batch waits for the one op
            self._dumps.setdefault(t.req_id, []).append(op)
        return op

    def take_reports(self) -> list[DumpReport]:
        """KV events: the numbered dumps this rank's store answered for since the last call
        (``get_kv_connector_kv_cache_events``; see ``transfer_notes.py``)."""
        return self.notes.take_reports()

    def _save_failed(self, n: int, why: str) -> None:
        self.stats.add(save_failed_blocks=n)
        if not self._save_trouble:
            log.warning(
                "kvfabric: storing KV blocks in the store %r failed (%s); later requests will miss them. "
                "Further failures are counted, not logged.",
                self.cfg.store,
                why,
            )
            self._save_trouble = True

    def _reap(self, block: bool = False) -> None:
        """Collect the statuses of finished dump ops (all of them when ``block``)."""
        if self.delegator is None:
            return
        seen: set[int] = set()
        for ops in (*self._dumps.values(), self._unsettled):
            for op in ops:
                if id(op) in seen or op.waited or not (block or op.check()):
                    continue
                seen.add(id(op))
                self._settle(op, None)
        if self._unsettled:
            self._unsettled = [op for op in self._unsettled if not op.waited]

    def _settle(self, op: DumpOp, timeout: float | None) -> None:
        """Wait for ``op`` (at most ``timeout``: the store then cancels what is left, as
        ``TIMEOUT``) and count its blocks stored or failed, naming the store's reasons."""
        batch: DumpBatch | None = getattr(op, "batch", None)
        if batch is not None:
            op.batch = None  # type: ignore[attr-defined]  # settles its batch once
        try:
            status = wait_or_cancel(op, timeout)
        except Exception as e:  # noqa: BLE001 - a failed dump is a future miss
            self._save_failed(op.num_blocks, f"{type(e).__name__}: {e}")
            if batch is not None:
                self.notes.batch_settled(batch, None)
            return
        if batch is not None:
            self.notes.batch_settled(batch, status)
        good = int((status == BlockStatus.OK).sum())
        if good < status.size:
            reasons = describe_reasons(failure_reasons(status))
            self._save_failed(status.size - good, f"{status.size - good} of {status.size} blocks: {reasons}")
        elif self._save_trouble:
            self._save_trouble = False
        assert self.delegator is not None
        per_block = getattr(op, "block_bytes", self.delegator.layout.block_bytes)
        if op.layer is not None:
            per_block = self.delegator.layout.layer_bytes(op.layer)
        secs = time.perf_counter() - getattr(op, "started", time.perf_counter())
        if op.layer in (None, 0):
            self.stats.add(saved_blocks=good)
        self.stats.add(saved_bytes=good * per_block, save_s=secs)

    def _await_release(self, op: DumpOp) -> bool:
        """Wait until ``op`` released its source blocks, at most ``load_timeout_s``; past
        it, cancel the op (its unfinished blocks fail as ``TIMEOUT``: a future miss) and
        return False. The store's cancel guarantees that nothing reads the blocks after it."""
        deadline = time.monotonic() + self.cfg.load_timeout_s
        while not op.released():
            if time.monotonic() >= deadline:
                if not op.waited:
                    self._settle(op, 0.0)
                return False
            time.sleep(0.0002)
        return True

    def preempted(self, req_ids: set[str]) -> None:
        """Wait for the dumps of preempted requests to release their blocks before vLLM
        reuses them, each at most ``load_timeout_s`` (see ``_await_release``)."""
        for r in req_ids:
            for op in self._dumps.get(r, []):
                self._await_release(op)

    def finished(self) -> set[str]:
        """Requests of earlier ``plan.finished`` whose dumps released their blocks."""
        self._reap()
        done = set()
        for r in self._awaiting:
            ops = self._dumps.get(r, [])
            if all(op.released() for op in ops):
                done.add(r)
        for r in done:
            self._awaiting.discard(r)
            self._dumps.pop(r, None)
            self.notes.forget(r)
        # requests whose last ops are all waited and not awaited any more keep nothing
        return done

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        self._async.cancel_all()  # nothing may write the KV cache after close
        if self.delegator is not None:
            self._reap(block=True)
            for delegator in self.delegators:
                delegator.close()
            self.delegator = None
            self.delegators = []
        for buf in self._wrapped:
            if not buf.freed and not self.platform.closed:
                self.platform.free(buf)
        self._wrapped.clear()
