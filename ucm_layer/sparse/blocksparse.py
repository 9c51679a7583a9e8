"""Block-sparse decode attention behind the ``UcmSparseBase`` hooks (GSA and its baselines).

``BlockSparseAttention`` drives one block scorer per (request, layer): it fits the scorer
on the whole prompt's keys (and the queries of the prompt's last ``query_window`` tokens,
for scorers that use them) when the request decodes its first token, appends every later
key (so the summaries follow the blocks as they fill), and, for each (request, layer)
that the adaptive switch puts in ``SPARSE`` mode, replaces the request's block table in
``attention_begin`` with the selected blocks of each KV head (forced sink/recent blocks +
top-k by score under the token budget), restoring it in ``attention_finished``. Selections are reused for
``reuse_steps`` decode steps; with ``select_ahead`` the selection for step t+1 is made at
step t from step t's query (what a prefetch needs). Scoring, top-k and the block-table
gather are tensor operations on the KV's device; statistics stay on the device until
``stats()`` is called.

The fit waits for the first decode step because an engine may prefill a prompt in chunks
(vLLM's chunked prefill gives a request a few hundred tokens of a step's budget, then the
rest in the next step): a basis fitted on the first chunk alone describes the start of the
prompt, not the prompt, and the summaries of every later block were made with it. Until
then the chunks' keys and the last queries are kept (:class:`PromptChunks`).

``gsa.plugin.GSA`` is this plugin with the SVD + max-norm scorer (``gsa.summary``) and,
given a store, offload of unselected blocks with prefetch of the next step's selection
(``gsa.offload``); the baselines (``baselines.plugins``) are this plugin with their scorers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from kvfabric.ucm_layer.sparse.base import (
    AttentionMetadata,
    AttnMode,
    LayerKV,
    ModelSpec,
    SparseMeta,
    StepBatch,
    UcmSparseBase,
)
from kvfabric.ucm_layer.sparse.gsa.policy import BlockSparseConfig, decide_modes
from kvfabric.ucm_layer.sparse.scorer import BlockScorer, make_scorer, scorer_option_names
from kvfabric.ucm_layer.sparse.selection import forced_blocks, lens_of, select_free


def query_tail(prev: torch.Tensor | None, query: torch.Tensor, window: int) -> torch.Tensor:
    """The last ``window`` queries ``(m, Hq, D)`` of a prompt whose earlier chunks left
    ``prev`` and whose next chunk is ``query`` (all of them for ``window`` 0); a copy, so
    that the step's query tensor is not kept alive."""
    q = query if prev is None else torch.cat([prev, query])
    return (q[-window:] if window else q).clone()


def recent_queries(query: torch.Tensor, num_kv_heads: int, window: int) -> torch.Tensor:
    """The prompt's queries ``(T, Hq, D)`` of its last ``window`` tokens (all for 0) as
    ``(Hkv, m * G, D)``, the ``G`` query heads of a KV head side by side, position order
    kept; tokens whose queries are all zero (not captured) are left out."""
    _, hq, d = query.shape
    q = query[-window:] if window else query
    captured = q.reshape(q.shape[0], -1).abs().amax(dim=1) > 0
    if not bool(captured.all()):
        q = q[captured]
    return (
        q.reshape(q.shape[0], num_kv_heads, hq // num_kv_heads, d)
        .permute(1, 0, 2, 3)
        .reshape(num_kv_heads, -1, d)
    )


@dataclass
class LayerState:
    """One (request, layer): its scorer and the selection being reused."""

    scorer: BlockScorer
    free: torch.Tensor | None = None  # (H, k_free) selected non-forced blocks
    made_step: int = -1
    k: int = 0
    ahead: torch.Tensor | None = None  # selection made at the previous step for this one
    free_mask: torch.Tensor | None = None  # (H, nb) bool: the previous selection


@dataclass
class PromptChunks:
    """One (request, layer) before its first decode step: the prompt's keys so far, chunk
    by chunk (``(H, n, D)`` each, copies), and its last ``query_window`` queries."""

    keys: list[torch.Tensor] = field(default_factory=list)
    queries: torch.Tensor | None = None
    tokens: int = 0

    def add(self, keys: torch.Tensor, query: torch.Tensor, window: int) -> None:
        self.keys.append(keys.clone())
        self.queries = query_tail(self.queries, query, window)
        self.tokens += int(keys.shape[1])


@dataclass
class RequestState:
    prompt_len: int
    layers: list[LayerState | None]
    extra: dict[str, Any] = field(default_factory=dict)
    prompt: dict[int, PromptChunks] = field(default_factory=dict)  # layer -> chunks not fitted yet


@dataclass(frozen=True)
class Slot:
    """One request of the step (batch index ``i``, ``seq`` tokens) in one layer: what the
    subclass hooks ``place`` and ``ahead_selected`` are given."""

    st: RequestState
    layer: int
    i: int
    seq: int
    kv: LayerKV
    attn: AttentionMetadata


class BlockSparseAttention(UcmSparseBase):
    """The generic block-sparse plugin (see the module docstring)."""

    name = "blocksparse"
    scorer_name = "gsa"
    #: a frozen ``kvfabric.settings`` dataclass of the keys only this plugin reads (its
    #: values in ``self.options``); None: none
    plugin_options: type | None = None

    def __init__(self, model: ModelSpec, config: Mapping[str, Any] | None = None) -> None:
        super().__init__(model, config)
        cfg = dict(self.config)
        self.scorer_name = cfg.pop("scorer", self.scorer_name)
        own = [f.name for f in fields(self.plugin_options)] if self.plugin_options is not None else []
        picked = {k: cfg.pop(k) for k in own if k in cfg}
        self.options = self.plugin_options(**picked) if self.plugin_options is not None else None
        self.cfg = BlockSparseConfig.from_mapping(
            cfg, scorer_option_names(self.scorer_name), also_known=("scorer", *own)
        )
        bad = [x for x in self.cfg.dense_layers if x >= model.num_layers]
        if bad:
            raise ValueError(f"dense_layers {bad} out of range: the model has {model.num_layers} layers")
        make_scorer(
            self.scorer_name, model.num_kv_heads, model.head_dim, model.block_size, **self.cfg.scorer_options
        )  # validate the scorer options now
        self._requests: dict[str, RequestState] = {}
        self._step = 0
        self._counters: dict[str, torch.Tensor | float] = {
            "selections": 0.0,
            "reused": 0.0,
            "sparse_layer_steps": 0.0,
            "dense_layer_steps": 0.0,
        }
        self._overlap_sum: torch.Tensor | float = 0.0
        self._overlap_n = 0.0

    # ------------------------------------------------------------------ scheduler side
    def request_begin(self, request_id: str, prompt_len: int) -> None:
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already began")
        if prompt_len < 1:
            raise ValueError(f"request {request_id!r}: prompt_len must be >= 1, got {prompt_len}")
        self._requests[request_id] = RequestState(prompt_len, [None] * self.model.num_layers)

    def request_finished(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def _state(self, request_id: str) -> RequestState:
        st = self._requests.get(request_id)
        if st is None:
            raise ValueError(f"unknown request {request_id!r}: request_begin() was not called")
        return st

    # ------------------------------------------------------------------ worker side
    def build_sparse_meta(self, batch: StepBatch, attn: AttentionMetadata) -> SparseMeta:
        for rid in batch.request_ids:
            self._state(rid)
        self._step += 1
        m = self.model
        modes = decide_modes(batch, m.num_layers, self.cfg, m.block_size, m.num_kv_heads * m.head_dim)
        return SparseMeta(batch=batch, modes=modes, step=self._step)

    @staticmethod
    def _token_ranges(batch: StepBatch) -> list[tuple[int, int]]:
        out, t = [], 0
        for n in batch.num_new:
            out.append((t, t + n))
            t += n
        return out

    def _sync_scorer(
        self, st: RequestState, layer: int, key: torch.Tensor, seq: int, n_new: int, query: torch.Tensor
    ) -> LayerState | None:
        """Keep a prompt chunk's keys and queries (None: no scorer yet), fit the scorer on
        the whole prompt at the first decode step, or extend it with the new keys."""
        keys = key.permute(1, 0, 2)  # (H, n, D)
        ls = st.layers[layer]
        start = seq - n_new
        if ls is not None:
            if ls.scorer.num_tokens == start:
                ls.scorer.append(keys, start)
            elif ls.scorer.num_tokens != seq:
                raise ValueError(
                    f"layer {layer}: scorer holds {ls.scorer.num_tokens} tokens, new keys start at {start}"
                )
            return ls
        chunks = st.prompt.get(layer)
        held = 0 if chunks is None else chunks.tokens
        if start != held:
            raise ValueError(
                f"layer {layer}: new keys start at position {start} but {held} prompt tokens were "
                "seen; the scorer must be fitted on the prompt from position 0"
            )
        if n_new > 1 or start == 0:  # a prompt (chunk): the fit waits for the whole prompt
            chunks = st.prompt.setdefault(layer, PromptChunks())
            chunks.add(keys, query, self.cfg.query_window)
            return None
        assert chunks is not None  # start == held > 0
        del st.prompt[layer]
        scorer = make_scorer(
            self.scorer_name,
            self.model.num_kv_heads,
            self.model.head_dim,
            self.model.block_size,
            **self.cfg.scorer_options,
        )
        prompt_q = chunks.queries
        assert prompt_q is not None
        scorer.fit(torch.cat(chunks.keys, dim=1), recent_queries(prompt_q, self.model.num_kv_heads, 0))
        scorer.append(keys, start)
        ls = st.layers[layer] = LayerState(scorer)
        return ls

    def _select_free(self, ls: LayerState, q: torch.Tensor, nb: int, k: int) -> torch.Tensor:
        """Top ``k - forced`` non-forced blocks ``(H, k_free)`` by the scorer's scores."""
        sink, recent = forced_blocks(nb, self.cfg.selection)
        if k - sink - recent <= 0:
            return torch.empty((self.model.num_kv_heads, 0), dtype=torch.int64, device=q.device)
        ranking, priority = ls.scorer.select_scores(q)
        idx = select_free(
            ranking, nb, k, self.cfg.selection, priority=priority, share=ls.scorer.priority_share
        )
        self._record_overlap(ls, idx, nb)
        self._counters["selections"] += 1.0
        return idx

    def _record_overlap(self, ls: LayerState, idx: torch.Tensor, nb: int) -> None:
        """Step-to-step reuse: the fraction of the new selection already in the last one."""
        valid = idx >= 0  # "layer" allocation leaves unused entries at -1
        idx = idx.clamp(min=0)
        if ls.free_mask is not None and idx.numel():
            prev = ls.free_mask
            if prev.shape[1] < nb:
                prev = torch.nn.functional.pad(prev, (0, nb - prev.shape[1]))
            hit = (prev.gather(1, idx) & valid).sum() / valid.sum().clamp(min=1)
            self._overlap_sum = self._overlap_sum + hit.float()
            self._overlap_n += 1.0
        mask = torch.zeros((idx.shape[0], nb), dtype=torch.bool, device=idx.device)
        ls.free_mask = mask.scatter_(1, idx, valid)

    def selection(self, ls: LayerState, q: torch.Tensor, seq: int, step: int) -> torch.Tensor:
        """The logical blocks ``(H, k)`` one KV head reads at ``step`` (forced + free); with
        ``allocation="layer"`` entries a head does not use are -1."""
        bs = self.model.block_size
        nb = -(-seq // bs)
        k = self.cfg.selection.num_selected(seq, bs)
        fresh = ls.free is None or ls.k != k or step - ls.made_step >= self.cfg.reuse_steps
        if fresh:
            if self.cfg.select_ahead and ls.ahead is not None and ls.k == k:
                ls.free = ls.ahead
            else:
                ls.free = self._select_free(ls, q, nb, k)
            ls.made_step, ls.k, ls.ahead = step, k, None
        else:
            self._counters["reused"] += 1.0
        sink, recent = forced_blocks(nb, self.cfg.selection)
        h, dev = self.model.num_kv_heads, q.device
        return torch.cat(
            [
                torch.arange(sink, device=dev).expand(h, sink),
                ls.free,
                torch.arange(nb - recent, nb, device=dev).expand(h, recent),
            ],
            dim=1,
        )

    def attention_begin(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv: LayerKV,
        attn: AttentionMetadata,
        meta: SparseMeta,
    ) -> None:
        self.layer_starting(layer, key, value, kv, meta)
        batch = meta.batch
        hk, g, d = self.model.num_kv_heads, self.model.group_size, self.model.head_dim
        for i, (t0, t1) in enumerate(self._token_ranges(batch)):
            st = self._state(batch.request_ids[i])
            seq = batch.seq_lens[i]
            ls = self._sync_scorer(st, layer, key[t0:t1], seq, t1 - t0, query[t0:t1])
            if ls is None or meta.mode(i, layer) is not AttnMode.SPARSE:
                self._counters["dense_layer_steps"] += 1.0
                continue
            self._counters["sparse_layer_steps"] += 1.0
            q = query[t1 - 1].reshape(hk, g, d)
            logical = self.selection(ls, q, seq, meta.step)
            if self.cfg.selection.allocation == "layer":  # unused entries: block 0, no tokens
                used = logical >= 0
                table, lens = self.place(Slot(st, layer, i, seq, kv, attn), logical.clamp(min=0))
                lens = lens * used
            else:
                table, lens = self.place(Slot(st, layer, i, seq, kv, attn), logical)
            attn.replace(i, table, lens, int(logical.shape[1]) * self.model.block_size)

    def layer_starting(
        self, layer: int, key: torch.Tensor, value: torch.Tensor, kv: LayerKV, meta: SparseMeta
    ) -> None:
        """Hook for subclasses: the start of ``attention_begin`` (``key``/``value`` are the
        step's new tokens, already in ``kv``)."""

    def layer_finishing(self, layer: int, kv: LayerKV, attn: AttentionMetadata, meta: SparseMeta) -> None:
        """Hook for subclasses: the start of ``attention_finished``, before ``attn`` is
        restored (``attn.saved`` holds the engine's entries of the replaced requests)."""

    def place(self, slot: Slot, logical: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Physical blocks and valid lengths ``(H, k)`` for the selected logical blocks.
        Without offload every block is where the engine's table says."""
        physical = slot.attn.block_tables[slot.i][0][logical]
        return physical, lens_of(logical, slot.seq, self.model.block_size)

    def attention_finished(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        output: torch.Tensor,
        kv: LayerKV,
        attn: AttentionMetadata,
        meta: SparseMeta,
    ) -> None:
        self.layer_finishing(layer, kv, attn, meta)
        attn.restore()
        if not self.cfg.select_ahead:
            return
        batch = meta.batch
        hk, g, d = self.model.num_kv_heads, self.model.group_size, self.model.head_dim
        for i, (_, t1) in enumerate(self._token_ranges(batch)):
            if meta.mode(i, layer) is not AttnMode.SPARSE:
                continue
            ls = self._state(batch.request_ids[i]).layers[layer]
            if ls is None or (meta.step + 1) - ls.made_step < self.cfg.reuse_steps:
                continue
            # the next step's sequence is one token longer; select for it now
            seq = batch.seq_lens[i] + 1
            nb = -(-seq // self.model.block_size)
            k = self.cfg.selection.num_selected(seq, self.model.block_size)
            if k != ls.k:
                continue
            ls.ahead = self._select_free(ls, query[t1 - 1].reshape(hk, g, d), nb, k)
            self.ahead_selected(Slot(self._state(batch.request_ids[i]), layer, i, seq - 1, kv, attn), ls)

    def ahead_selected(self, slot: Slot, ls: LayerState) -> None:
        """Hook for subclasses: ``ls.ahead`` was just chosen for the next step (prefetch it)."""

    def stats(self) -> dict[str, float]:
        out = {k: float(v) for k, v in self._counters.items()}
        out["step_reuse"] = float(self._overlap_sum) / self._overlap_n if self._overlap_n else float("nan")
        return out


__all__ = [
    "BlockSparseAttention",
    "LayerState",
    "PromptChunks",
    "RequestState",
    "Slot",
    "query_tail",
    "recent_queries",
]
