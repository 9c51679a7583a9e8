"""vLLM's per-layer attention forward mapped onto one ``UcmSparseBase`` plugin.

One :class:`SparseRuntime` per worker process (shared by every attention layer of the
model; built by the first layer's impl). Call order, driven by the backend impl's
``forward`` of every layer ``l`` (vLLM has already written the step's keys and values into
the paged cache):

``plan(metadata, block_table, seq_lens, query_start_loc)``
    once per step (the first layer that sees a new metadata object; every layer of a KV
    cache group shares it): finishes the previous step (``execute_finished``, stats file),
    identifies the batch's requests, admits new ones (``request_begin``), builds the
    plugin's :class:`StepBatch` / :class:`AttentionMetadata` and calls
    ``build_sparse_meta`` (the adaptive dense/sparse switch). Returns None when no
    request is managed (the impl then runs the wrapped kernel untouched).
``layer_begin(plan, l, (query, key, value), kv)``
    the plugin's summaries take the step's new keys, per KV head; returns a
    :class:`LayerSelection` (the sparse rows' per-head ``(S, H, k)`` physical blocks and
    valid lengths) or None when no row is sparse in this layer.
``layer_end(plan, l, output, kv)``
    after the last layer: the end of the step (stats file).

Two ways to drive the plugin, chosen once (``paged_support``):

batched (``sparse.paged.PagedSelector``: every block-sparse algorithm without
``select_ahead``/offload)
    the step's rows are classified once in ``plan`` (prompt chunks, whose last queries are
    kept; first decode steps, which fit the summaries on the whole prompt read from the
    cache, so that a prompt vLLM prefilled in chunks is summarised as one; decode rows; the
    rows that select and their padded block tables, ``paged.SparseRows``); per layer one
    batched summary update (the new keys of the rows that may select; the others' only
    when a block fills, from the cache: ``_plan_decode_keys``) and one batched selection
    (a few tensor operations, no loop over requests, heads or blocks). A one-token chunk
    in the middle of a prompt (a step's budget ending one token into it) looks like a
    decode step to an attention backend: the fit then happens there, on the tokens so far,
    and the rest of the prompt extends the summaries. The summaries are keyed by
    physical block; before a step, every block a continuing row's state has seen must
    still be owned by that state (``owner``, one gather per step), or the row runs dense
    and the state is dropped (``identity_mismatch``).
hooks (any other ``UcmSparseBase`` plugin)
    ``build_sparse_meta`` / ``attention_begin`` / ``attention_finished`` /
    ``execute_finished`` per step and layer, per request, as the contract says.

Request identity: vLLM hands an attention backend no request ids (neither the forward
context nor the metadata carry them), so a request is keyed by its block-table row: the
physical block holding its first token (private to a request that computed its prompt
from position 0; freed only when the request ends, so a new prefill from position 0 on
the same block means the old request finished) plus the number of tokens the plugin has
seen for it, which must equal the row's first new position. A row that matches no state
(a prefix-cache hit that did not compute its prompt from position 0, a state evicted
because more than ``max_requests`` rows were tracked) stays dense; two rows matching one
state in a step are both dense and the state is dropped. A state no row matched for
``idle_steps`` steps is finished (``request_finished``): vLLM schedules a running request
in every step, and a finished request's row never comes back.

Memory: the runtime reads vLLM's metadata and the step's query/key/value; it never writes
vLLM's tensors (the impl rewrites copies of the block table). Stats are host counters; with
a ``stats_path`` every step's snapshot goes to a :class:`statsfile.StatsFile`, whose thread
writes the file (current within about 0.25 s of the last step; at ``close``, at once).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvfabric.ucm_layer.sparse.base import (
    AttentionMetadata,
    LayerKV,
    ModelSpec,
    SparseMeta,
    StepBatch,
    UcmSparseBase,
    create,
)
from kvfabric.ucm_layer.sparse.gsa.policy import VLLM_MIN_SKIPPED_KV, worth_sparse
from kvfabric.ucm_layer.sparse.paged import PagedSelector, SparseRows, paged_support
from kvfabric.ucm_layer.sparse.vllm import timing
from kvfabric.ucm_layer.sparse.vllm.config import SparseBackendConfig
from kvfabric.ucm_layer.sparse.vllm.statsfile import StatsFile

if TYPE_CHECKING:
    import torch


@dataclass
class _Tracked:
    """One request as the runtime knows it."""

    rid: str
    first_block: int
    tokens: int = 0  # tokens the plugin has seen (keys appended)
    last_step: int = 0
    slot: int = -1  # the batched selector's slot
    fitted: bool = False  # batched: summaries fitted on the prompt (at its first decode step)
    synced: bool = False  # batched: the summaries hold every key before the next token's


@dataclass(frozen=True)
class LayerSelection:
    """The rows of one layer that read a selection: vLLM ``rows`` (ascending), the token
    of each (``token_index (S,)`` int64; ``identity``: the tokens are ``0..S-1``), per-head
    ``physical (S, H, k)`` blocks and ``lens (S, H, k)`` valid tokens (0: unused entry).
    ``kernel_lens`` ``(S * H,)`` int32, when not None, are the folded sequences' lengths,
    the same object for every layer of the step, with the partial block last in every head
    (``paged.SparseRows.tail_last``); ``cache`` is the step's memo for the impl."""

    rows: tuple[int, ...]
    token_index: torch.Tensor
    identity: bool
    physical: torch.Tensor
    lens: torch.Tensor
    kernel_lens: torch.Tensor | None
    cache: dict[Any, Any]


@dataclass
class _Group:
    """Sparse decode rows of one step sharing a block count (``paged.SparseRows``)."""

    rows: list[int]  # vLLM rows
    tokens: torch.Tensor  # their tokens
    identity: bool
    sparse: SparseRows
    kernel_lens: torch.Tensor | None


@dataclass
class StepPlan:
    """One step: the vLLM rows the plugin manages and what it decided for them."""

    metadata: Any  # the vLLM metadata object (kept: its identity marks the step)
    rows: list[int]  # vLLM batch rows managed, in plugin batch order
    token_index: torch.Tensor | None  # the managed rows' tokens (None: every token, in order)
    decode_rows: int  # vLLM rows decoding this step (managed or not)
    attn: AttentionMetadata | None
    meta: SparseMeta | None
    done: bool = False
    stock: bool = False  # every layer of the step runs the stock forward (plan() gave None)
    tokens: tuple[Any, ...] = ()  # the managed rows' query, key, value of the current layer
    # batched mode
    block_table: Any = None
    chunks: list[tuple[int, int, int, int, int]] = field(default_factory=list)  # (row, slot, t0, t1, start)
    fits: list[tuple[int, int, int]] = field(default_factory=list)  # (row, slot, prompt tokens)
    extends: list[tuple[int, int, int, int, int]] = field(default_factory=list)  # (row, slot, t0, t1, start)
    dec_slots: Any = None  # (Sd,) slots of the decode rows
    dec_tokens: Any = None  # (Sd,) their tokens
    dec_identity: bool = False
    dec_phys: Any = None  # (Sd,) physical block of each new token
    dec_fresh: Any = None  # (Sd,) bool: the new token starts its block
    seal_slots: Any = None  # sealing selector: the slots of the blocks summarised this step,
    seal_phys: Any = None  # their physical blocks
    seal_counts: Any = None  # and the keys each holds
    groups: list[_Group] = field(default_factory=list)
    blocks_selected: int = 0  # per sparse layer: sum over rows of blocks read per head
    blocks_total: int = 0  # ... and of the blocks dense reads
    cache: dict[Any, Any] = field(default_factory=dict)
    qsl: list[int] = field(default_factory=list)  # the step's query_start_loc

    @property
    def idle(self) -> bool:
        """Batched mode: no summary to update and no row to select in any layer."""
        return not (
            self.chunks
            or self.fits
            or self.extends
            or self.groups
            or self.seal_slots is not None
            or self.dec_phys is not None
        )


@dataclass
class LayerCounters:
    sparse: int = 0  # (request, layer) decode steps run sparse
    dense: int = 0  # (request, layer) decode steps run dense


@dataclass
class RuntimeStats:
    steps: int = 0
    requests: int = 0
    blocks_selected: int = 0  # per sparse (request, layer): mean over KV heads of blocks read
    blocks_total: int = 0  # ... and the blocks the dense kernel would have read
    identity_mismatch: int = 0  # rows whose blocks were not all their state's: run dense
    prompt_chunks: int = 0  # prompt chunks after a first one (vLLM's chunked prefill)
    layers: list[LayerCounters] = field(default_factory=list)


class SparseRuntime:
    """The plugin, the request tracking and the counters of one worker (see module doc)."""

    def __init__(
        self,
        config: SparseBackendConfig,
        spec: ModelSpec,
        rank: int = 0,
        max_requests: int = 4096,
        idle_steps: int = 32,
        batched: bool = True,
    ) -> None:
        if not config.enabled:
            raise ValueError("SparseRuntime needs a configuration with an algorithm")
        self.config, self.spec = config, spec
        self.plugin: UcmSparseBase = create(str(config.algorithm), spec, engine_options(config))
        self.paged: PagedSelector | None = (
            PagedSelector(self.plugin)  # type: ignore[arg-type]
            if batched and paged_support(self.plugin) is None
            else None
        )
        self.max_requests, self.idle_steps = max_requests, idle_steps
        self.stats_path = config.stats_path.replace("{rank}", str(rank)) if config.stats_path else None
        self.stats_file = StatsFile(self.stats_path) if self.stats_path else None
        self.stats = RuntimeStats(layers=[LayerCounters() for _ in range(spec.num_layers)])
        self._by_block: dict[int, _Tracked] = {}
        self._next_id = 0
        self._plan: StepPlan | None = None
        self._last_layer = spec.num_layers - 1

    # ------------------------------------------------------------------ requests
    def _begin(self, st: _Tracked, prompt_len: int) -> None:
        if self.paged is not None:
            st.slot = self.paged.begin(st.rid)
        else:
            self.plugin.request_begin(st.rid, prompt_len)

    def _end(self, st: _Tracked) -> None:
        if self.paged is not None:
            self.paged.finish(st.rid)
        else:
            self.plugin.request_finished(st.rid)

    def _match(
        self, num_reqs: int, qsl: list[int], seqs: list[int], firsts: list[int], step: int
    ) -> tuple[list[tuple[int, _Tracked]], int]:
        """The rows that match a state (new prefills from position 0 get one), in row order,
        and the number of decoding rows."""
        chosen: dict[int, tuple[int, _Tracked]] = {}  # first block -> (row, state)
        clashes: set[int] = set()
        decode_rows = 0
        for i in range(num_reqs):
            n, seq, blk = qsl[i + 1] - qsl[i], int(seqs[i]), int(firsts[i])
            if n <= 0:
                continue
            decode_rows += n == 1 and seq > 1
            if seq == n:  # computes from position 0: a new request on this block
                old = self._by_block.pop(blk, None)
                if old is not None:
                    self._end(old)
                st = _Tracked(f"vllm-{self._next_id}", blk)
                self._next_id += 1
                self._begin(st, seq)
                self._by_block[blk] = st
                self.stats.requests += 1
            else:
                st = self._by_block.get(blk)
                if st is None or st.tokens != seq - n:
                    continue
            if blk in chosen:
                clashes.add(blk)
            chosen[blk] = (i, st)
        for blk in clashes:  # two rows claim one state: neither is trusted
            chosen.pop(blk)
            st = self._by_block.pop(blk)
            self._end(st)
        return sorted(chosen.values(), key=lambda x: x[0]), decode_rows

    # ------------------------------------------------------------------ steps
    def plan(
        self,
        metadata: Any,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        num_blocks: int | None = None,
    ) -> StepPlan | None:
        """The plan of the step ``metadata`` belongs to (built on its first layer);
        ``num_blocks``: physical blocks of the cache (batched mode; default: the table's
        largest entry + 1)."""
        prev = self._plan
        if prev is not None and prev.metadata is metadata:
            return None if prev.stock else prev
        if prev is not None and not prev.done:
            self._finish_step(prev)
        self.stats.steps += 1
        step = self.stats.steps
        num_reqs = int(query_start_loc.numel()) - 1
        qsl = query_start_loc.tolist()
        seqs = seq_lens[:num_reqs].tolist()
        firsts = block_table[:num_reqs, 0].tolist()
        picked, decode_rows = self._match(num_reqs, qsl, seqs, firsts, step)
        self.stats.prompt_chunks += sum(1 for i, _ in picked if 1 < qsl[i + 1] - qsl[i] < seqs[i])
        if timing.clock is not None:  # selection times for the connector's spans
            timing.clock.step(str(self.config.algorithm), picked)
        if self.paged is not None:
            plan = self._plan_batched(metadata, block_table, qsl, seqs, picked, decode_rows, step, num_blocks)
        else:
            plan = self._plan_hooks(
                metadata, block_table, query_start_loc, qsl, seqs, picked, decode_rows, step
            )
        plan.qsl = qsl
        self._evict(step)
        self._plan = plan
        if not plan.rows or (self.paged is not None and plan.idle):
            # nothing to summarise or select: the stock forward, no per-layer work
            plan.done = plan.stock = True
            if self.paged is not None:
                self.paged.counters.dense_layer_steps += len(plan.rows) * self.spec.num_layers
            self.stats_dense_only(decode_rows)
            return None
        return plan

    def _plan_hooks(
        self,
        metadata: Any,
        block_table: torch.Tensor,
        query_start_loc: torch.Tensor,
        qsl: list[int],
        seqs: list[int],
        picked: list[tuple[int, _Tracked]],
        decode_rows: int,
        step: int,
    ) -> StepPlan:
        import torch

        from kvfabric.ucm_layer.sparse.attention import dense_table

        num_reqs = len(qsl) - 1
        rows = [i for i, _ in picked]
        tables, lens, seq_list, nnew, rids = [], [], [], [], []
        for i, st in picked:
            seq, n = int(seqs[i]), qsl[i + 1] - qsl[i]
            t, ln = dense_table(seq, block_table[i].to(torch.int64), self.spec.block_size)
            tables.append(t)
            lens.append(ln)
            seq_list.append(seq)
            nnew.append(n)
            rids.append(st.rid)
            st.tokens, st.last_step = seq, step
        if rows == list(range(num_reqs)) and qsl[0] == 0:
            index = None
        elif rows:
            index = torch.cat([torch.arange(qsl[i], qsl[i + 1]) for i in rows]).to(query_start_loc.device)
        else:
            index = None
        empty = torch.empty((0, 2), dtype=torch.int64)
        attn = AttentionMetadata(tables, lens, seq_list, [empty] * len(rows))
        if rows:
            batch = StepBatch(tuple(rids), tuple(seq_list), tuple(nnew))
            meta = self.plugin.build_sparse_meta(batch, attn)
        else:
            meta = SparseMeta(batch=StepBatch((), (), ()), modes=(), step=step)
        return StepPlan(metadata, rows, index, decode_rows, attn, meta)

    def _plan_batched(
        self,
        metadata: Any,
        block_table: torch.Tensor,
        qsl: list[int],
        seqs: list[int],
        picked: list[tuple[int, _Tracked]],
        decode_rows: int,
        step: int,
        num_blocks: int | None,
    ) -> StepPlan:
        import torch

        paged = self.paged
        assert paged is not None
        bs = self.spec.block_size
        dev = block_table.device
        if num_blocks is None:
            num_blocks = int(block_table.max()) + 1 if block_table.numel() else 1
        owner = paged.ensure_blocks(num_blocks, dev)
        picked = self._check_owner(block_table, owner, picked)
        plan = StepPlan(
            metadata, [i for i, _ in picked], None, decode_rows, None, None, block_table=block_table
        )
        cfg = self.plugin.cfg  # type: ignore[attr-defined]
        sel = cfg.selection
        seals = paged.seals
        decs: list[tuple[int, _Tracked, int]] = []  # (row, state, position of the new token)
        long: list[tuple[int, int, int]] = []  # (row, seq, slot)
        sealed: list[tuple[int, int, int, int]] = []  # (row, slot, logical block, keys)
        for i, st in picked:
            seq, n = int(seqs[i]), qsl[i + 1] - qsl[i]
            start = seq - n
            nb_prev, nb_new = -(-start // bs), -(-seq // bs)
            if nb_new > nb_prev:  # the state now owns its new blocks
                owner[block_table[i, nb_prev:nb_new].to(torch.int64)] = st.slot
            if not st.fitted and (start == 0 or n > 1):  # a prompt chunk
                plan.chunks.append((i, st.slot, qsl[i], qsl[i + 1], start))
            elif n > 1 and seals:  # the blocks the chunk wrote (and the one before), from the cache
                for b in range((start - 1) // bs, (seq - 1) // bs + 1):
                    sealed.append((i, st.slot, b, min(seq - b * bs, bs)))
                st.synced = True
            elif n > 1:
                plan.extends.append((i, st.slot, qsl[i], qsl[i + 1], start))
            else:
                if not st.fitted:  # the first decode step: the prompt is complete
                    plan.fits.append((i, st.slot, start))
                    st.fitted = st.synced = True
                decs.append((i, st, seq - 1))
                if seq >= cfg.min_seq_len and sel.num_selected(seq, bs) * bs < seq:
                    long.append((i, seq, st.slot))
            st.tokens, st.last_step = seq, step
        dev_t = functools.partial(torch.tensor, dtype=torch.int64, device=dev)
        sparse_step = worth_sparse(
            [q for _, q, _ in long], cfg, bs, self.spec.num_kv_heads * self.spec.head_dim
        )
        if decs:
            # on a step the switch keeps dense no row selects: with seals none adds its key
            # (a block that fills is sealed, the next selection refreshes the partial block)
            may_select = {r for r, _, _ in long} if sparse_step else set()
            appended = self._plan_decode_keys(decs, may_select, seals, sealed)
            if appended:
                rows_t = dev_t([i for i, _, _ in appended])
                pos = dev_t([p for _, _, p in appended])
                tok = [qsl[i] for i, _, _ in appended]
                plan.dec_slots = dev_t([st.slot for _, st, _ in appended])
                plan.dec_identity = tok == list(range(len(tok)))
                plan.dec_tokens = dev_t(tok)
                plan.dec_phys = block_table[rows_t, pos // bs].to(torch.int64)
                plan.dec_fresh = pos % bs == 0
        if sealed:
            srows, slots, blocks, counts = zip(*sealed)
            plan.seal_slots, plan.seal_counts = dev_t(slots), dev_t(counts)
            plan.seal_phys = block_table[dev_t(srows), dev_t(blocks)].to(torch.int64)
        if sparse_step:
            by_k: dict[int, list[tuple[int, int, int]]] = {}
            for r in long:
                by_k.setdefault(sel.num_selected(r[1], bs), []).append(r)
            h = self.spec.num_kv_heads
            for k, rs in sorted(by_k.items()):
                rows = [r for r, _, _ in rs]
                tok = [qsl[r] for r in rows]
                sr = SparseRows(
                    block_table[torch.tensor(rows, dtype=torch.int64, device=dev)],
                    [s for _, s, _ in rs],
                    [sl for _, _, sl in rs],
                    self.plugin,  # type: ignore[arg-type]
                )
                kl = None
                if sr.tail_last:
                    per_row = (k - 1) * bs + sr.tail
                    kl = per_row.repeat_interleave(h).to(torch.int32)
                plan.groups.append(
                    _Group(
                        rows,
                        torch.tensor(tok, dtype=torch.int64, device=dev),
                        tok == list(range(len(tok))),
                        sr,
                        kl,
                    )
                )
                plan.blocks_selected += k * len(rs)
                plan.blocks_total += sum(-(-s // bs) for _, s, _ in rs)
        return plan

    def _plan_decode_keys(
        self,
        decs: list[tuple[int, _Tracked, int]],
        long: set[int],
        seals: bool,
        sealed: list[tuple[int, int, int, int]],
    ) -> list[tuple[int, _Tracked, int]]:
        """How each decode row's new key reaches the summaries: the rows whose key is
        appended per token (returned), and the blocks summarised from the cache (added to
        ``sealed``). Without ``seals`` every row appends. With it (``PagedSelector.seals``),
        a row that may select (``long``) keeps its summaries exact: it appends while they
        hold every earlier key (``synced``), else its partial block (and the block before,
        if that just filled) is summarised from the cache; any other row is left behind
        (no work per token) and only a block that fills while it lags is summarised."""
        if not seals:
            return decs
        bs = self.spec.block_size
        appended = []
        for i, st, p in decs:
            fresh = p % bs == 0 and p >= bs
            if i in long:
                if st.synced:
                    appended.append((i, st, p))
                else:
                    if fresh:
                        sealed.append((i, st.slot, p // bs - 1, bs))
                    sealed.append((i, st.slot, p // bs, p % bs + 1))
                st.synced = True
            else:
                if fresh and not st.synced:
                    sealed.append((i, st.slot, p // bs - 1, bs))
                st.synced = False
        return appended

    def _check_owner(
        self, block_table: torch.Tensor, owner: torch.Tensor, picked: list[tuple[int, _Tracked]]
    ) -> list[tuple[int, _Tracked]]:
        """Drop (and finish) the continuing rows one of whose seen blocks another state owns:
        their summaries would be another request's (one gather for the step)."""
        import torch

        bs = self.spec.block_size
        cont = [(j, i, st) for j, (i, st) in enumerate(picked) if st.tokens > 0]
        if not cont:
            return picked
        seen = [-(-st.tokens // bs) for _, _, st in cont]
        width = max(seen)
        dev = block_table.device
        rows = torch.tensor([i for _, i, _ in cont], dtype=torch.int64, device=dev)
        tb = block_table[rows, :width].to(torch.int64)
        slots = torch.tensor([st.slot for _, _, st in cont], dtype=torch.int64, device=dev)
        same = owner[tb] == slots.view(-1, 1)
        if min(seen) < width:  # rows that saw fewer blocks: their later entries are not theirs yet
            mask = torch.arange(width, device=dev).view(1, -1) < torch.tensor(seen, device=dev).view(-1, 1)
            same |= ~mask
        ok = same.all(dim=1).tolist()
        if all(ok):
            return picked
        bad = {j for (j, _, st), good in zip(cont, ok) if not good}
        for j in bad:
            st = picked[j][1]
            self._by_block.pop(st.first_block, None)
            self._end(st)
            self.stats.identity_mismatch += 1
        return [p for j, p in enumerate(picked) if j not in bad]

    def _evict(self, step: int) -> None:
        """Finish the states no row matched for ``idle_steps`` steps (vLLM schedules a running
        request every step; a finished one never matches again), then the oldest beyond
        ``max_requests``."""
        idle = [st for st in self._by_block.values() if step - st.last_step > self.idle_steps]
        over = len(self._by_block) - len(idle) - self.max_requests
        if over > 0:
            live = (st for st in self._by_block.values() if st.last_step < step and st not in idle)
            idle += sorted(live, key=lambda s: s.last_step)[:over]
        for st in idle:
            self._by_block.pop(st.first_block, None)
            self._end(st)

    def stats_dense_only(self, decode_rows: int) -> None:
        """A step with no managed request: every decoding row ran dense in every layer."""
        for c in self.stats.layers:
            c.dense += decode_rows
        self._write_stats()

    # ------------------------------------------------------------------ layers
    def _subset(self, plan: StepPlan, x: torch.Tensor) -> torch.Tensor:
        return x if plan.token_index is None else x.index_select(0, plan.token_index)

    def layer_begin(
        self, plan: StepPlan, layer: int, tokens: tuple[torch.Tensor, torch.Tensor, torch.Tensor], kv: LayerKV
    ) -> LayerSelection | None:
        """The step's ``tokens`` (query, key, value of every vLLM row) into the plugin's
        summaries; the selection of the rows that are sparse in this layer, if any."""
        self._last_layer = max(self._last_layer, layer)
        t0 = timing.now() if timing.clock is not None else 0
        if self.paged is not None:
            out = self._layer_batched(plan, layer, tokens, kv)
        else:
            out = self._layer_hooks(plan, layer, tokens, kv)
        if timing.clock is not None and out is not None:  # selection times for the connector's spans
            timing.clock.selected(out.rows, t0, timing.now())
        return out

    def _layer_batched(
        self, plan: StepPlan, layer: int, tokens: tuple[torch.Tensor, torch.Tensor, torch.Tensor], kv: LayerKV
    ) -> LayerSelection | None:
        import torch

        paged = self.paged
        assert paged is not None
        q, k, _ = tokens
        bt = plan.block_table
        for _, slot, t0, t1, start in plan.chunks:
            paged.prompt_chunk(layer, slot, q[t0:t1], start)
        for i, slot, tokens in plan.fits:
            paged.fit_prompt(layer, kv, slot, tokens, bt[i])
        for i, slot, t0, t1, start in plan.extends:
            paged.extend(layer, kv, slot, k[t0:t1], start, bt[i])
        if plan.seal_slots is not None:
            paged.seal(layer, kv, plan.seal_slots, plan.seal_phys, plan.seal_counts)
        if plan.dec_phys is not None:
            n = int(plan.dec_slots.numel())
            keys = k[:n] if plan.dec_identity else k.index_select(0, plan.dec_tokens)
            paged.append(layer, kv, plan.dec_slots, keys, plan.dec_phys, plan.dec_fresh)
        counters = self.stats.layers[layer]
        dense_layer = layer in self.plugin.cfg.dense_layers  # type: ignore[attr-defined]
        if not plan.groups or dense_layer:
            counters.dense += plan.decode_rows
            paged.counters.dense_layer_steps += len(plan.rows)
            return None
        out = []
        for g in plan.groups:
            qs = q[: len(g.rows)] if g.identity else q.index_select(0, g.tokens)
            physical, lens = paged.select(layer, kv, g.sparse, qs)
            out.append((g, physical, lens))
        nsparse = sum(len(g.rows) for g in plan.groups)
        counters.sparse += nsparse
        counters.dense += plan.decode_rows - nsparse
        paged.counters.sparse_layer_steps += nsparse
        paged.counters.dense_layer_steps += len(plan.rows) - nsparse
        self.stats.blocks_selected += plan.blocks_selected
        self.stats.blocks_total += plan.blocks_total
        if len(out) == 1:
            g, physical, lens = out[0]
            return LayerSelection(
                tuple(g.rows), g.tokens, g.identity, physical, lens, g.kernel_lens, plan.cache
            )
        kmax = max(int(p.shape[-1]) for _, p, _ in out)
        pad = torch.nn.functional.pad
        rows = [r for g, _, _ in out for r in g.rows]
        perm = sorted(range(len(rows)), key=rows.__getitem__)
        phys = torch.cat([pad(p, (0, kmax - p.shape[-1])) for _, p, _ in out])[perm]
        lens = torch.cat([pad(ln, (0, kmax - ln.shape[-1])) for _, _, ln in out])[perm]
        toks = torch.cat([g.tokens for g, _, _ in out])[perm]
        rows_sorted = tuple(rows[j] for j in perm)
        return LayerSelection(rows_sorted, toks, False, phys, lens, None, plan.cache)

    def _layer_hooks(
        self, plan: StepPlan, layer: int, tokens: tuple[torch.Tensor, torch.Tensor, torch.Tensor], kv: LayerKV
    ) -> LayerSelection | None:
        import torch

        assert plan.attn is not None and plan.meta is not None
        q, k, v = plan.tokens = tuple(self._subset(plan, x) for x in tokens)
        self.plugin.attention_begin(layer, q, k, v, kv, plan.attn, plan.meta)
        counters = self.stats.layers[layer]
        bs = self.spec.block_size
        h = self.spec.num_kv_heads
        rows, tabs, lens = [], [], []
        for j, i in enumerate(plan.rows):
            saved = plan.attn.saved.get(j)
            if saved is None:
                continue
            table, ln = plan.attn.block_tables[j], plan.attn.block_lens[j]
            rows.append(i)
            tabs.append(table.expand(h, -1))
            lens.append(ln.expand(h, -1))
            self.stats.blocks_selected += int(table.shape[-1])
            self.stats.blocks_total += -(-saved[2] // bs)
        counters.sparse += len(rows)
        counters.dense += plan.decode_rows - len(rows)
        if not rows:
            return None
        width = max(int(t.shape[-1]) for t in tabs)
        pad = torch.nn.functional.pad
        physical = torch.stack([pad(t, (0, width - t.shape[-1])) for t in tabs])
        lens_t = torch.stack([pad(ln, (0, width - ln.shape[-1])) for ln in lens])
        tok = [plan.qsl[i] for i in rows]
        return LayerSelection(
            tuple(rows), torch.tensor(tok, dtype=torch.int64), False, physical, lens_t, None, plan.cache
        )

    def layer_end(self, plan: StepPlan, layer: int, output: torch.Tensor, kv: LayerKV) -> None:
        """``attention_finished`` (hooks mode); after the step's last layer, the end of the step."""
        if self.paged is None:
            assert plan.attn is not None and plan.meta is not None
            q, k, v = plan.tokens
            self.plugin.attention_finished(
                layer, q, k, v, self._subset(plan, output), kv, plan.attn, plan.meta
            )
        if layer >= self._last_layer:
            self._finish_step(plan)

    def _finish_step(self, plan: StepPlan) -> None:
        plan.done = True
        if self.paged is None and plan.meta is not None:
            self.plugin.execute_finished(plan.meta)
        self._write_stats()

    # ------------------------------------------------------------------ stats
    def snapshot(self) -> dict[str, Any]:
        """The counters as one JSON-able mapping (what the stats file holds)."""
        s = self.stats
        raw = self.paged.stats() if self.paged is not None else self.plugin.stats()
        plugin = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in raw.items()}
        return {
            "algorithm": self.config.algorithm,
            "pid": os.getpid(),
            "batched": self.paged is not None,
            "steps": s.steps,
            "requests": s.requests,
            "tracked_requests": len(self._by_block),
            "sparse_layer_steps": sum(c.sparse for c in s.layers),
            "dense_layer_steps": sum(c.dense for c in s.layers),
            "blocks_selected": s.blocks_selected,
            "blocks_total": s.blocks_total,
            "identity_mismatch": s.identity_mismatch,
            "prompt_chunks": s.prompt_chunks,
            "layers": [{"sparse": c.sparse, "dense": c.dense} for c in s.layers],
            "plugin": plugin,
        }

    def _write_stats(self) -> None:
        if self.stats_file is not None:  # written by the file's thread, off the forward
            self.stats_file.publish(self.snapshot())

    def close(self) -> None:
        """Finish the pending step, write the stats (now), release the plugin."""
        if self._plan is not None and not self._plan.done:
            self._finish_step(self._plan)
        if self.stats_file is not None:
            self.stats_file.close()
        self.plugin.close()


def engine_options(config: SparseBackendConfig) -> dict[str, Any]:
    """The algorithm's options in an engine: the user's, with the engine's default for the
    cost-aware switch (``min_skipped_kv``) where the algorithm has that switch and the user
    gave none."""
    from kvfabric.ucm_layer.sparse.base import ALGORITHMS
    from kvfabric.ucm_layer.sparse.blocksparse import BlockSparseAttention

    opts = dict(config.options)
    cls = ALGORITHMS.load(str(config.algorithm))
    if "min_skipped_kv" not in opts and isinstance(cls, type) and issubclass(cls, BlockSparseAttention):
        opts["min_skipped_kv"] = VLLM_MIN_SKIPPED_KV
    return opts


_RUNTIMES: dict[tuple[ModelSpec, str], SparseRuntime] = {}


def runtime_for(config: SparseBackendConfig, spec: ModelSpec, rank: int = 0) -> SparseRuntime:
    """The worker's runtime for this model and configuration (built, and the algorithm's
    options validated, by the first attention layer; shared by the others)."""
    key = (spec, repr(config))
    rt = _RUNTIMES.get(key)
    if rt is None:
        rt = _RUNTIMES[key] = SparseRuntime(config, spec, rank)
    return rt


def layer_index(layer_name: str) -> int:
    """``model.layers.7.self_attn.attn`` -> 7 (the one integer of the name)."""
    nums = [int(p) for p in layer_name.split(".") if p.isdigit()]
    if len(nums) != 1:
        raise ValueError(f"cannot tell the layer index of attention layer {layer_name!r}")
    return nums[0]


__all__ = ["LayerSelection", "SparseRuntime", "StepPlan", "engine_options", "layer_index", "runtime_for"]
