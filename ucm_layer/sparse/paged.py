"""Block selection for a whole decode batch at once, over an engine's paged KV cache.

``BlockSparseAttention``'s hooks select per (request, layer), one Python call chain per
request. An engine that hands the plugin its physical block tables (vLLM's attention
backend) can instead use :class:`PagedSelector`, which does the same selection for every
request of a step in one layer with a few tensor operations:

- summaries live in one preallocated tensor per layer indexed by **physical block**
  (``(H, width, num_blocks)``), written when the request decodes its first token (from
  the prompt's keys in the cache, :meth:`PagedSelector.fit_prompt`: the whole prompt,
  however many chunks the engine prefilled it in), then, as decode tokens come, either
  from the cache (``seal``: a block once when it fills, and the partial last block of a
  row that starts selecting while its summaries lag: a request below the switch costs
  nothing per token) or in place per token (``append``: every request that may select,
  one gather / ``where`` / scatter for the step). A request's other per-layer state (GSA's basis) is
  one row of a per-layer ``(slots, ...)`` tensor;
- scoring is one product of every row's query weights with the store, one gather of the
  scores of the rows' blocks by their padded block tables (:class:`SparseRows`, built once
  per step and shared by every layer), one masked softmax, one ``topk`` (plus one for the
  mixed ranking's bound share), one gather of the physical blocks.

Which algorithms: every registered block scorer. GSA (``residual_groups = 1``) and Quest
through their max-rows (``RowMaxScorer``), mean key through per-block sums, the oracle
and HATA read the keys of the batch's blocks from the cache (they keep one row per token).
:func:`paged_support` says why a configuration is not supported (``select_ahead``,
``reuse_steps`` > 1, offload, a scorer not listed); the engine then uses the per-request hooks.

The results equal the per-request hooks' selections (``tests/unit/test_sparse_paged.py``):
same summaries, same softmax over the request's blocks, same top-k.

Request identity is the engine's business (a slot per request, :meth:`PagedSelector.begin`);
the selector trusts that a slot's blocks are the ones it was given. ``owner`` (one slot per
physical block) lets the engine check that before a step (:meth:`PagedSelector.check_owner`).
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvfabric.ucm_layer.sparse.base import LayerKV
from kvfabric.ucm_layer.sparse.blocksparse import query_tail, recent_queries
from kvfabric.ucm_layer.sparse.scorer import (
    SCORERS,
    BlockScorer,
    RowMaxScorer,
    block_view,
    edge_block_view,
    make_scorer,
)
from kvfabric.ucm_layer.sparse.selection import forced_blocks

if TYPE_CHECKING:
    from kvfabric.ucm_layer.sparse.blocksparse import BlockSparseAttention

_NEG = float("-inf")


def paged_support(plugin: Any) -> str | None:
    """Why ``plugin`` cannot select through :class:`PagedSelector` (None: it can)."""
    from kvfabric.ucm_layer.sparse.blocksparse import BlockSparseAttention

    if not isinstance(plugin, BlockSparseAttention):
        return f"{type(plugin).__name__} is not a block-sparse plugin"
    if plugin.cfg.select_ahead:
        return "select_ahead selects for the next step (per-request hooks)"
    if plugin.cfg.reuse_steps != 1:
        return "reuse_steps > 1 keeps per-request selections (per-request hooks)"
    if getattr(plugin, "offload", False):
        return "offload manages device slots (per-request hooks)"
    if plugin.scorer_name not in _PAGED_SCORERS:
        return f"scorer {plugin.scorer_name!r} has no batched form"
    if plugin.scorer_name == "gsa" and int(plugin.cfg.scorer_options.get("residual_groups", 1)) != 1:
        return "gsa with residual_groups > 1 has no batched form"
    return None


class SparseRows:
    """The decode rows of one step that select (layer-invariant; built once per step).

    ``tables (S, W)`` int64: each row's physical blocks (entries past its ``nb`` blocks are
    padding), ``seqs``: tokens per row, ``slots``: the selector's slot of each row. Derived
    once here: the valid and selectable (not forced) block masks, the forced logical blocks,
    the partial last block's length, and, when every row's last block is always read
    (``recent_blocks >= 1``, head allocation), the kernel's lengths."""

    def __init__(
        self,
        tables: torch.Tensor,
        seqs: list[int],
        slots: list[int],
        plugin: BlockSparseAttention,
    ) -> None:
        bs = plugin.model.block_size
        sel = plugin.cfg.selection
        dev = tables.device
        self.size = len(seqs)
        nbs = [-(-s // bs) for s in seqs]
        ks = {sel.num_selected(s, bs) for s in seqs}
        if len(ks) != 1:
            raise ValueError(f"sparse rows must share one block count, got {sorted(ks)}")
        self.k = ks.pop()
        forced = {forced_blocks(nb, sel) for nb in nbs}
        if len(forced) != 1:
            raise ValueError("sparse rows must share their forced block counts")
        self.sink, self.recent = forced.pop()
        self.free = self.k - self.sink - self.recent
        width = max(nbs)
        self.width = width
        self.tables = tables[:, :width].to(torch.int64)
        self.slots = torch.tensor(slots, dtype=torch.int64, device=dev)
        self.nb = torch.tensor(nbs, dtype=torch.int64, device=dev)
        self.ragged = len(set(nbs)) > 1
        pos = torch.arange(width, device=dev).view(1, width)
        self.valid = pos < self.nb.view(-1, 1)
        self.mid = (pos >= self.sink) & (pos < (self.nb - self.recent).view(-1, 1))
        self.outside = (~self.mid).view(self.size, 1, width)  # what the ranking masks, every layer
        self.tail = torch.tensor(
            [s - (nb - 1) * bs for s, nb in zip(seqs, nbs)], dtype=torch.int64, device=dev
        )
        h = plugin.model.num_kv_heads
        sink = torch.arange(self.sink, device=dev).view(1, 1, -1).expand(self.size, h, self.sink)
        recent = (self.nb.view(-1, 1) - self.recent + torch.arange(self.recent, device=dev)).view(
            -1, 1, self.recent
        )
        self.sink_idx, self.recent_idx = sink, recent.expand(self.size, h, self.recent)
        self.block_size = bs
        # the last logical block (the only partial one) is the last entry of every head
        self.tail_last = self.recent >= 1 and (sel.allocation == "head" or h == 1)
        # then every entry is used and only the last is partial: the kernel's lengths per entry
        self.entry_lens: torch.Tensor | None = None
        if self.tail_last:
            lens = torch.full((self.size, h, self.k), bs, dtype=torch.int64, device=dev)
            lens[:, :, -1] = self.tail.view(-1, 1)
            self.entry_lens = lens
        self._tokens_valid: torch.Tensor | None = None
        self._counts: torch.Tensor | None = None

    @property
    def counts(self) -> torch.Tensor:
        """``(S, W)`` tokens in each listed block (0 past a row's blocks)."""
        if self._counts is None:
            bs = self.block_size
            full = torch.full_like(self.tables, bs)
            last = torch.arange(self.width, device=self.tables.device).view(1, -1) == (self.nb - 1).view(
                -1, 1
            )
            c = torch.where(last, self.tail.view(-1, 1), full)
            self._counts = c * self.valid
        return self._counts

    @property
    def tokens_valid(self) -> torch.Tensor:
        """``(S, W, block_size)`` bool: token ``t`` of listed block ``n`` holds a key."""
        if self._tokens_valid is None:
            t = torch.arange(self.block_size, device=self.tables.device).view(1, 1, -1)
            self._tokens_valid = t < self.counts.unsqueeze(-1)
        return self._tokens_valid


class PagedScorer(abc.ABC):
    """One layer's summaries of every request, keyed by physical block (see module doc).

    ``fit`` (a request's first keys, from position 0, written to ``blocks``), ``extend``
    (later keys of one request, several tokens), ``append`` (one new key per request for a
    batch), ``scores`` (``(S, H, W)`` ranking and optional priority for the rows)."""

    def __init__(
        self, template: BlockScorer, options: dict[str, Any], num_blocks: int, like: torch.Tensor
    ) -> None:
        self.t, self.options = template, options
        self.h, self.d, self.bs = template.num_kv_heads, template.head_dim, template.block_size
        self.num_blocks = num_blocks
        self.like = like

    def fit(self, slot: int, keys: torch.Tensor, queries: torch.Tensor | None, blocks: torch.Tensor) -> None:
        """``keys (H, n, D)`` of positions ``0..n-1`` held by physical ``blocks``."""

    def extend(self, slot: int, keys: torch.Tensor, start: int, blocks: torch.Tensor) -> None:
        """``keys (H, n, D)`` at positions ``start...`` of the request whose blocks are ``blocks``."""

    def append(
        self, slots: torch.Tensor, keys: torch.Tensor, phys: torch.Tensor, fresh: torch.Tensor
    ) -> None:
        """One key per request: ``keys (S, H, D)`` into physical blocks ``phys (S,)``;
        ``fresh (S,)``: the key is its block's first."""

    #: whether :meth:`seal` summarises a full block from the cache (else decode keys need ``append``)
    seals: bool = False

    def seal(self, slots: torch.Tensor, kv: LayerKV, phys: torch.Tensor, counts: torch.Tensor) -> None:
        """The summaries of physical blocks ``phys (S,)`` (one per slot ``slots (S,)``) from
        their first ``counts (S,)`` keys in ``kv`` (1..block_size; the rest are not read):
        what ``append`` of each of those keys would have made."""
        raise NotImplementedError(f"{type(self).__name__} summarises per key (append)")

    @abc.abstractmethod
    def scores(
        self, rows: SparseRows, q: torch.Tensor, kv: LayerKV
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(ranking (S, H, W), priority (S, H, W) or None)`` for ``q (S, H, G, D)``;
        entries of padding blocks are arbitrary (masked by the caller)."""


def _masked_softmax_sum(s: torch.Tensor, rows: SparseRows) -> torch.Tensor:
    """``s (S, H, G, W)`` -> per KV head summed softmax over each row's blocks."""
    if rows.ragged:
        s = s.masked_fill(~rows.valid.view(rows.size, 1, 1, -1), _NEG)
    return torch.softmax(s, dim=-1).sum(dim=-2)


class _ColumnStore(PagedScorer):
    """Summaries ``(H, width, num_blocks)``, one column per physical block, plus per-slot
    params. Scoring multiplies every row's weights with the columns of the whole store in
    one product and gathers the rows' blocks from it (reading the store once, contiguous),
    unless the store is much larger than the rows' blocks (then their columns are gathered
    first)."""

    width: int
    #: the whole store is multiplied when it holds at most this many times the rows' blocks
    full_product_ratio: float = 4.0

    def __init__(
        self, template: BlockScorer, options: dict[str, Any], num_blocks: int, like: torch.Tensor
    ) -> None:
        super().__init__(template, options, num_blocks, like)
        self.store = torch.zeros((self.h, self.width, num_blocks), dtype=like.dtype, device=like.device)
        self.params: torch.Tensor | None = None

    def _set_params(self, slot: int, p: torch.Tensor | None) -> None:
        if p is None:
            return
        if self.params is None or slot >= self.params.shape[0]:
            cap = max(16, 2 * (slot + 1))
            new = torch.zeros((cap, *p.shape), dtype=p.dtype, device=p.device)
            if self.params is not None:
                new[: self.params.shape[0]] = self.params
            self.params = new
        self.params[slot] = p

    def _params(self, slots: torch.Tensor) -> torch.Tensor | None:
        return None if self.params is None else self.params.index_select(0, slots)

    def _write(self, blocks: torch.Tensor, cols: torch.Tensor) -> None:
        """``cols (H, width, n)`` into physical ``blocks (n,)``."""
        self.store.index_copy_(2, blocks, cols)

    def _products(self, w: torch.Tensor, rows: SparseRows) -> torch.Tensor:
        """``w (S, H, R, width) . summaries`` of each row's listed blocks: ``(S, H, R, W)``."""
        s, h, r, width = w.shape
        if self.num_blocks <= self.full_product_ratio * s * rows.width:
            prod = torch.bmm(w.transpose(0, 1).reshape(h, s * r, width), self.store).view(h, s, r, -1)
            idx = rows.tables.view(s, 1, 1, -1).expand(s, h, r, rows.width)
            return prod.transpose(0, 1).gather(-1, idx)  # contiguous (S, H, R, W)
        cols = self.store.index_select(2, rows.tables.reshape(-1)).view(h, width, s, -1).permute(2, 0, 1, 3)
        return torch.matmul(w, cols)


class RowMaxPaged(_ColumnStore):
    """GSA and Quest: element-wise max rows per block (``RowMaxScorer``)."""

    def __init__(
        self, template: BlockScorer, options: dict[str, Any], num_blocks: int, like: torch.Tensor
    ) -> None:
        if not isinstance(template, RowMaxScorer):
            raise TypeError("RowMaxPaged needs a RowMaxScorer")
        self.rm: RowMaxScorer = template
        self.width = template.row_width
        super().__init__(template, options, num_blocks, like)
        self.scale = 1.0 / math.sqrt(self.d)

    def fit(self, slot: int, keys: torch.Tensor, queries: torch.Tensor | None, blocks: torch.Tensor) -> None:
        sc = make_scorer(self.t.name, self.h, self.d, self.bs, **self.options)
        assert isinstance(sc, RowMaxScorer)
        sc.fit(keys, queries)
        self._set_params(slot, sc.batch_params())
        self._write(blocks[: sc.num_blocks], sc.summaries.transpose(1, 2))

    def extend(self, slot: int, keys: torch.Tensor, start: int, blocks: torch.Tensor) -> None:
        n = keys.shape[1]
        params = None if self.params is None else self.params[slot]
        rows = self.rm.rows_with(keys, params)  # (H, n, W)
        b0, b1 = start // self.bs, (start + n - 1) // self.bs
        lead = start % self.bs
        pad = rows[:, :1].expand(-1, lead, -1) if lead else rows[:, :0]
        fresh = edge_block_view(torch.cat([pad, rows], dim=1), self.bs).amax(dim=2)  # (H, nblk, W)
        phys = blocks[b0 : b1 + 1]
        if lead:  # the first block already holds keys: merge
            fresh[:, 0] = torch.maximum(fresh[:, 0], self.store[:, :, phys[0]])
        self._write(phys, fresh.transpose(1, 2))

    def append(
        self, slots: torch.Tensor, keys: torch.Tensor, phys: torch.Tensor, fresh: torch.Tensor
    ) -> None:
        rows = (
            self.rm.rows_with(keys.unsqueeze(2), self._params(slots)).squeeze(2).permute(1, 2, 0)
        )  # (H, W, S)
        cur = self.store.index_select(2, phys)
        self._write(phys, torch.where(fresh.view(1, 1, -1), rows, torch.maximum(cur, rows)))

    seals = True

    def seal(self, slots: torch.Tensor, kv: LayerKV, phys: torch.Tensor, counts: torch.Tensor) -> None:
        # indexing, not index_select, which copies a strided cache view whole (vLLM CPU's
        # keys); then contiguous: the products below take a slow path on strided keys
        keys = kv.k[:, phys].transpose(0, 1).contiguous()  # (S, H, bs, D)
        rows = self.rm.rows_with(keys, self._params(slots))  # (S, H, bs, width)
        held = torch.arange(self.bs, device=phys.device).view(1, 1, -1, 1) < counts.view(-1, 1, 1, 1)
        self._write(phys, rows.masked_fill(~held, _NEG).amax(dim=2).permute(1, 2, 0))

    def scores(
        self, rows: SparseRows, q: torch.Tensor, kv: LayerKV
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        params = self._params(rows.slots)
        w = self.rm.select_weights_with(q, params)  # (S, H, G(+1), width)
        share = self.rm.priority_share
        s = self._products(w * self.scale, rows)  # (S, H, G(+1), W)
        if not share:
            return _masked_softmax_sum(s, rows), None
        g = q.shape[2]
        return _masked_softmax_sum(s[:, :, :g], rows), s[:, :, g]


class MeanKeyPaged(_ColumnStore):
    """Mean key: per-block key sums, divided by the block's tokens when scoring."""

    def __init__(
        self, template: BlockScorer, options: dict[str, Any], num_blocks: int, like: torch.Tensor
    ) -> None:
        self.width = template.head_dim
        super().__init__(template, options, num_blocks, like)
        self.scale = 1.0 / math.sqrt(self.d)

    def fit(self, slot: int, keys: torch.Tensor, queries: torch.Tensor | None, blocks: torch.Tensor) -> None:
        sums = block_view(keys, self.bs, 0.0).sum(dim=2)  # (H, nb, D)
        self._write(blocks[: sums.shape[1]], sums.transpose(1, 2))

    def extend(self, slot: int, keys: torch.Tensor, start: int, blocks: torch.Tensor) -> None:
        n = keys.shape[1]
        b0, b1 = start // self.bs, (start + n - 1) // self.bs
        lead = start % self.bs
        pad = keys.new_zeros((keys.shape[0], lead, keys.shape[2]))
        sums = block_view(torch.cat([pad, keys], dim=1), self.bs, 0.0).sum(dim=2)
        phys = blocks[b0 : b1 + 1]
        if lead:
            sums[:, 0] += self.store[:, :, phys[0]]
        self._write(phys, sums.transpose(1, 2))

    def append(
        self, slots: torch.Tensor, keys: torch.Tensor, phys: torch.Tensor, fresh: torch.Tensor
    ) -> None:
        k = keys.permute(1, 2, 0)  # (H, D, S)
        cur = self.store.index_select(2, phys)
        self._write(phys, torch.where(fresh.view(1, 1, -1), k, cur + k))

    seals = True

    def seal(self, slots: torch.Tensor, kv: LayerKV, phys: torch.Tensor, counts: torch.Tensor) -> None:
        keys = kv.k[:, phys]  # (H, S, bs, D)
        held = torch.arange(self.bs, device=phys.device).view(1, 1, -1, 1) < counts.view(1, -1, 1, 1)
        self._write(phys, keys.masked_fill(~held, 0.0).sum(dim=2).transpose(1, 2))  # (H, D, S)

    def scores(
        self, rows: SparseRows, q: torch.Tensor, kv: LayerKV
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        s = self._products(q * self.scale, rows)  # (S, H, G, W): q . sums
        s = s / rows.counts.clamp(min=1).view(rows.size, 1, 1, -1).to(q.dtype)
        return _masked_softmax_sum(s, rows), None


class CacheReadPaged(PagedScorer):
    """The oracle and HATA keep a row per token: both read the batch's keys from the cache."""

    def _keys(self, rows: SparseRows, kv: LayerKV) -> torch.Tensor:
        """``(S, H, W, block_size, D)`` keys of the rows' listed blocks."""
        return kv.k[:, rows.tables].permute(1, 0, 2, 3, 4)

    def scores(
        self, rows: SparseRows, q: torch.Tensor, kv: LayerKV
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        keys = self._keys(rows, kv)
        valid = rows.tokens_valid.view(rows.size, 1, 1, rows.width, self.bs)
        if self.t.name == "oracle":
            s = torch.einsum("shgd,shntd->shgnt", q, keys) / math.sqrt(self.d)
            s = s.masked_fill(~valid, _NEG).flatten(-2)
            p = torch.softmax(s, dim=-1).view(*s.shape[:3], rows.width, self.bs).sum(dim=-1)
            return p.sum(dim=2), None
        proj = getattr(self.t, "_proj", None)
        if proj is None:
            raise ValueError("hata: no projections")
        proj = proj.to(device=q.device, dtype=q.dtype)  # (H, D, bits)
        code_q = torch.where(torch.einsum("shgd,hdb->shgb", q, proj) >= 0, 1.0, -1.0)
        code_k = torch.where(torch.einsum("shntd,hdb->shntb", keys, proj) >= 0, 1.0, -1.0)
        agree = torch.einsum("shgb,shntb->shgnt", code_q, code_k).masked_fill(~valid, _NEG)
        return agree.amax(dim=-1).amax(dim=2), None


_PAGED_SCORERS: dict[str, type[PagedScorer]] = {
    "gsa": RowMaxPaged,
    "quest": RowMaxPaged,
    "meankey": MeanKeyPaged,
    "oracle": CacheReadPaged,
    "hata": CacheReadPaged,
}


@dataclass
class PagedCounters:
    """Host counters (no device sync): selections made, (request, layer) decode steps."""

    selections: int = 0
    sparse_layer_steps: int = 0
    dense_layer_steps: int = 0


class PagedSelector:
    """Batched selection for one plugin (see the module docstring). Not thread-safe; one
    per worker. Slots are small integers reused after :meth:`finish`."""

    def __init__(self, plugin: BlockSparseAttention) -> None:
        why = paged_support(plugin)
        if why is not None:
            raise ValueError(f"no batched selection: {why}")
        self.plugin = plugin
        m = plugin.model
        self.h, self.g, self.d, self.bs = m.num_kv_heads, m.group_size, m.head_dim, m.block_size
        self.options = dict(plugin.cfg.scorer_options)
        self.template = make_scorer(plugin.scorer_name, self.h, self.d, self.bs, **self.options)
        if plugin.scorer_name == "hata":
            self.template.prepare(torch.zeros((self.h, 1, self.d)))  # type: ignore[attr-defined]
        self._kind = _PAGED_SCORERS[plugin.scorer_name]
        assert SCORERS.load(plugin.scorer_name) is type(self.template)
        self.layers: list[PagedScorer | None] = [None] * m.num_layers
        # per layer, slot -> the last query_window queries of a prompt not fitted yet
        self._prompt_q: list[dict[int, torch.Tensor]] = [{} for _ in range(m.num_layers)]
        self.owner: torch.Tensor | None = None  # (num_blocks,) slot owning each physical block
        self._slots: dict[str, int] = {}
        self._free: list[int] = []
        self.counters = PagedCounters()
        self.priority_share = float(getattr(self.template, "priority_share", 0.0))

    # ------------------------------------------------------------------ requests
    def begin(self, rid: str) -> int:
        """A slot for request ``rid`` (its summaries are written by ``fit``)."""
        if rid in self._slots:
            raise ValueError(f"request {rid!r} already began")
        slot = self._free.pop() if self._free else len(self._slots)
        self._slots[rid] = slot
        return slot

    def finish(self, rid: str) -> None:
        """Release ``rid``'s slot (idempotent); its blocks' summaries are overwritten by the
        next request that fits on them."""
        slot = self._slots.pop(rid, None)
        if slot is not None:
            for held in self._prompt_q:
                held.pop(slot, None)
            self._free.append(slot)

    def ensure_blocks(self, num_blocks: int, device: torch.device) -> torch.Tensor:
        """The owner table for a cache of ``num_blocks`` physical blocks (-1: nobody)."""
        if self.owner is None or self.owner.numel() < num_blocks:
            self.owner = torch.full((num_blocks,), -1, dtype=torch.int64, device=device)
        return self.owner

    # ------------------------------------------------------------------ layers
    def layer(self, layer: int, kv: LayerKV) -> PagedScorer:
        ps = self.layers[layer]
        if ps is None:
            ps = self.layers[layer] = self._kind(self.template, self.options, kv.num_blocks, kv.k)
        return ps

    def fit(
        self,
        layer: int,
        kv: LayerKV,
        slot: int,
        keys: torch.Tensor,
        query: torch.Tensor,
        blocks: torch.Tensor,
    ) -> None:
        """A request's prompt, from position 0, given directly: ``keys (n, H, D)``,
        ``query (n, Hq, D)``, physical ``blocks`` of its table row (an engine whose prompts
        may come in chunks uses :meth:`prompt_chunk` and :meth:`fit_prompt`)."""
        q = recent_queries(query, self.h, self.plugin.cfg.query_window)
        self.layer(layer, kv).fit(slot, keys.permute(1, 0, 2), q, blocks.to(torch.int64))

    def prompt_chunk(self, layer: int, slot: int, query: torch.Tensor, start: int) -> None:
        """A chunk of a request's prompt at positions ``start...`` (``query (n, Hq, D)``; its
        keys are in the cache): keep the prompt's last ``query_window`` queries for
        :meth:`fit_prompt` (``start`` 0 begins the prompt)."""
        held = self._prompt_q[layer]
        held[slot] = query_tail(held.get(slot) if start else None, query, self.plugin.cfg.query_window)

    def fit_prompt(self, layer: int, kv: LayerKV, slot: int, tokens: int, blocks: torch.Tensor) -> None:
        """Fit the slot's summaries on its whole prompt, positions ``0..tokens-1``, whose
        keys are read from ``kv`` through the table row ``blocks``, and the queries
        :meth:`prompt_chunk` kept; called at the request's first decode step, whatever the
        chunks were."""
        nb = -(-tokens // self.bs)
        row = blocks[:nb].to(torch.int64)
        keys = kv.k[:, row].reshape(self.h, nb * self.bs, self.d)[:, :tokens]
        query = self._prompt_q[layer].pop(slot, None)
        q = None if query is None else recent_queries(query, self.h, 0)
        self.layer(layer, kv).fit(slot, keys, q, row)

    def extend(
        self, layer: int, kv: LayerKV, slot: int, keys: torch.Tensor, start: int, blocks: torch.Tensor
    ) -> None:
        """Later keys ``(n, H, D)`` of one request at positions ``start...``."""
        if keys.shape[0]:
            self.layer(layer, kv).extend(slot, keys.permute(1, 0, 2), start, blocks.to(torch.int64))

    def append(
        self,
        layer: int,
        kv: LayerKV,
        slots: torch.Tensor,
        keys: torch.Tensor,
        phys: torch.Tensor,
        fresh: torch.Tensor,
    ) -> None:
        """One new key per decoding request, ``keys (S, H, D)`` (see ``PagedScorer.append``)."""
        if slots.numel():
            self.layer(layer, kv).append(slots, keys, phys, fresh)

    @property
    def seals(self) -> bool:
        """Whether the scorer can summarise a block from the cache (:meth:`seal`), so that
        decode keys need no per-token :meth:`append` for a request that does not select: an
        engine then seals each block once when it fills, and before a lagging request's
        first selection its partial last block (whose summary is in the softmax's
        normaliser), which gives every selection the summaries per-token updates make."""
        return self._kind.seals

    def seal(
        self, layer: int, kv: LayerKV, slots: torch.Tensor, phys: torch.Tensor, counts: torch.Tensor
    ) -> None:
        """Blocks ``phys (S,)`` of slots ``slots (S,)`` summarised from their first
        ``counts (S,)`` keys in ``kv`` (see :attr:`seals`)."""
        if slots.numel():
            self.layer(layer, kv).seal(slots, kv, phys, counts)

    def select(
        self, layer: int, kv: LayerKV, rows: SparseRows, q: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The physical blocks ``(S, H, k)`` every KV head of every row reads, and their valid
        tokens ``(S, H, k)`` (0: an entry a head does not use), for decode queries
        ``q (S, Hq, D)``. With ``rows.tail_last`` the last entry of every head is its
        row's last (partial) block."""
        s = rows.size
        sel = self.plugin.cfg.selection
        q = q.reshape(s, self.h, self.g, self.d)
        self.counters.selections += s
        if rows.free > 0:
            ranking, priority = self.layer(layer, kv).scores(rows, q, kv)
            ranking = ranking.masked_fill(rows.outside, _NEG)
            first = min(rows.free, round(self.priority_share * rows.free)) if priority is not None else 0
            if first > 0 and priority is not None:
                top = torch.topk(
                    priority.masked_fill(rows.outside, _NEG), first, dim=-1, sorted=False
                ).indices
                ranking = ranking.scatter(-1, top, float("inf"))
            if sel.allocation == "head" or self.h == 1:
                free = torch.topk(ranking, rows.free, dim=-1, sorted=False).indices
            else:
                cap = min(rows.width, math.ceil(sel.head_cap * rows.free))
                vals, idx = torch.topk(ranking, cap, dim=-1, sorted=False)
                chosen = torch.topk(vals.reshape(s, -1), self.h * rows.free, dim=-1, sorted=False).indices
                keep = torch.zeros((s, self.h * cap), dtype=torch.bool, device=q.device)
                keep.scatter_(1, chosen, True)
                free = torch.where(keep.view(s, self.h, cap), idx, torch.full_like(idx, -1))
            logical = torch.cat([rows.sink_idx, free, rows.recent_idx], dim=-1)
        else:
            logical = torch.cat([rows.sink_idx, rows.recent_idx], dim=-1)
        # head allocation with the partial block last: every entry used, lengths per step
        fixed = rows.entry_lens
        if fixed is None:
            used = logical >= 0
            logical = logical.clamp(min=0)
        physical = rows.tables.gather(1, logical.reshape(s, -1)).view_as(logical)
        if fixed is not None:
            return physical, fixed
        last = logical == (rows.nb - 1).view(-1, 1, 1)
        lens = torch.where(last, rows.tail.view(-1, 1, 1), torch.full_like(logical, self.bs)) * used
        return physical, lens

    def stats(self) -> dict[str, float]:
        c = self.counters
        return {
            "selections": float(c.selections),
            "reused": 0.0,
            "sparse_layer_steps": float(c.sparse_layer_steps),
            "dense_layer_steps": float(c.dense_layer_steps),
            "step_reuse": float("nan"),
            "batched": 1.0,
        }


__all__ = ["PagedCounters", "PagedScorer", "PagedSelector", "SparseRows", "paged_support"]
