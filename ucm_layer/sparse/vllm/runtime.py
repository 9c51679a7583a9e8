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
``layer_begin(plan, l, (query, key, value))``
    ``attention_begin`` with the managed requests' tokens (the plugin appends the new keys
    to its block summaries, per KV head); returns, for every request the plugin put in
    sparse mode, its per-head ``(H, k)`` physical blocks and valid lengths.
``layer_end(plan, l, output)``
    ``attention_finished`` (restores the plugin's view, selects ahead if configured); after
    the last layer, ``execute_finished`` and the stats file.

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
vLLM's tensors (the impl rewrites copies of the block table). Stats are host counters.
"""

from __future__ import annotations

import json
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
from kvfabric.ucm_layer.sparse.vllm import timing
from kvfabric.ucm_layer.sparse.vllm.config import SparseBackendConfig

if TYPE_CHECKING:
    import torch


@dataclass
class _Tracked:
    """One request as the runtime knows it."""

    rid: str
    first_block: int
    tokens: int = 0  # tokens the plugin has seen (keys appended)
    last_step: int = 0


@dataclass
class StepPlan:
    """One step: the vLLM rows the plugin manages and what it decided for them."""

    metadata: Any  # the vLLM metadata object (kept: its identity marks the step)
    rows: list[int]  # vLLM batch rows managed, in plugin batch order
    token_index: torch.Tensor | None  # the managed rows' tokens (None: every token, in order)
    decode_rows: int  # vLLM rows decoding this step (managed or not)
    attn: AttentionMetadata
    meta: SparseMeta
    done: bool = False
    tokens: tuple[Any, ...] = ()  # the managed rows' query, key, value of the current layer


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
    ) -> None:
        if not config.enabled:
            raise ValueError("SparseRuntime needs a configuration with an algorithm")
        self.config, self.spec = config, spec
        self.plugin: UcmSparseBase = create(str(config.algorithm), spec, dict(config.options))
        self.max_requests, self.idle_steps = max_requests, idle_steps
        self.stats_path = config.stats_path.replace("{rank}", str(rank)) if config.stats_path else None
        self.stats = RuntimeStats(layers=[LayerCounters() for _ in range(spec.num_layers)])
        self._by_block: dict[int, _Tracked] = {}
        self._next_id = 0
        self._plan: StepPlan | None = None
        self._last_layer = spec.num_layers - 1

    # ------------------------------------------------------------------ steps
    def plan(
        self,
        metadata: Any,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
    ) -> StepPlan | None:
        """The plan of the step ``metadata`` belongs to (built on its first layer)."""
        prev = self._plan
        if prev is not None and prev.metadata is metadata:
            return prev if prev.rows else None
        if prev is not None and not prev.done:
            self._finish_step(prev)
        import torch

        from kvfabric.ucm_layer.sparse.attention import dense_table

        self.stats.steps += 1
        step = self.stats.steps
        num_reqs = int(query_start_loc.numel()) - 1
        qsl = query_start_loc.tolist()
        seqs = seq_lens[:num_reqs].tolist()
        firsts = block_table[:num_reqs, 0].tolist()
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
                    self.plugin.request_finished(old.rid)
                st = _Tracked(f"vllm-{self._next_id}", blk)
                self._next_id += 1
                self.plugin.request_begin(st.rid, seq)
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
            self.plugin.request_finished(st.rid)
        picked = sorted(chosen.values(), key=lambda x: x[0])
        if timing.clock is not None:  # selection times for the connector's spans
            timing.clock.step(str(self.config.algorithm), picked)
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
        self._evict(step)
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
        self._plan = StepPlan(metadata, rows, index, decode_rows, attn, meta)
        if not rows:
            self._plan.done = True
            self.stats_dense_only(decode_rows)
            return None
        return self._plan

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
            self.plugin.request_finished(st.rid)

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
    ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """``attention_begin`` with the step's ``tokens`` (query, key, value of every vLLM
        row); the sparse rows' ``(H, k)`` physical blocks and lengths, by vLLM row."""
        self._last_layer = max(self._last_layer, layer)
        t0 = timing.now() if timing.clock is not None else 0
        q, k, v = plan.tokens = tuple(self._subset(plan, x) for x in tokens)
        self.plugin.attention_begin(layer, q, k, v, kv, plan.attn, plan.meta)
        out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        counters = self.stats.layers[layer]
        bs = self.spec.block_size
        for j, i in enumerate(plan.rows):
            saved = plan.attn.saved.get(j)
            if saved is None:
                continue
            table, lens = plan.attn.block_tables[j], plan.attn.block_lens[j]
            out[i] = (table.expand(self.spec.num_kv_heads, -1), lens.expand(self.spec.num_kv_heads, -1))
            self.stats.blocks_selected += int(table.shape[-1])
            self.stats.blocks_total += -(-saved[2] // bs)
        counters.sparse += len(out)
        counters.dense += plan.decode_rows - len(out)
        if timing.clock is not None:
            timing.clock.selected(list(out), t0, timing.now())
        return out

    def layer_end(self, plan: StepPlan, layer: int, output: torch.Tensor, kv: LayerKV) -> None:
        """``attention_finished``; after the step's last layer, ``execute_finished`` + stats."""
        q, k, v = plan.tokens
        self.plugin.attention_finished(layer, q, k, v, self._subset(plan, output), kv, plan.attn, plan.meta)
        if layer >= self._last_layer:
            self._finish_step(plan)

    def _finish_step(self, plan: StepPlan) -> None:
        plan.done = True
        self.plugin.execute_finished(plan.meta)
        self._write_stats()

    # ------------------------------------------------------------------ stats
    def snapshot(self) -> dict[str, Any]:
        """The counters as one JSON-able mapping (what the stats file holds)."""
        s = self.stats
        plugin = {
            k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in self.plugin.stats().items()
        }
        return {
            "algorithm": self.config.algorithm,
            "pid": os.getpid(),
            "steps": s.steps,
            "requests": s.requests,
            "tracked_requests": len(self._by_block),
            "sparse_layer_steps": sum(c.sparse for c in s.layers),
            "dense_layer_steps": sum(c.dense for c in s.layers),
            "blocks_selected": s.blocks_selected,
            "blocks_total": s.blocks_total,
            "layers": [{"sparse": c.sparse, "dense": c.dense} for c in s.layers],
            "plugin": plugin,
        }

    def _write_stats(self) -> None:
        if self.stats_path is None:
            return
        tmp = f"{self.stats_path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.snapshot(), f)
        os.replace(tmp, self.stats_path)

    def close(self) -> None:
        """Finish the pending step, write the stats, release the plugin."""
        if self._plan is not None and not self._plan.done:
            self._finish_step(self._plan)
        self.plugin.close()


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


__all__ = ["SparseRuntime", "StepPlan", "layer_index", "runtime_for"]
