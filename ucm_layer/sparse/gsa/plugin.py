"""GSA behind the ``UcmSparseBase`` hooks: the block-sparse plugin with GSA's summary and offload."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kvfabric.settings import coerce_fields, setting
from kvfabric.ucm_layer.sparse.base import (
    AttentionMetadata,
    AttnMode,
    LayerKV,
    ModelSpec,
    SparseMeta,
    StepBatch,
)
from kvfabric.ucm_layer.sparse.blocksparse import BlockSparseAttention, LayerState, Slot
from kvfabric.ucm_layer.sparse.gsa.offload import OffloadStats, Residency
from kvfabric.ucm_layer.sparse.selection import forced_blocks, lens_of
from kvfabric.ucm_layer.store.base import Store


@dataclass(frozen=True)
class OffloadOptions:
    """GSA's own keys (beside ``BlockSparseConfig``'s and the scorer's), checked like every
    kvfabric config."""

    offload: bool = setting(False, doc="keep only the sink, recent and cache blocks on the device")
    cache_blocks: int | None = setting(
        None, lo=1, doc="offload: device slots for selected blocks (None: 2 x free)"
    )

    def __post_init__(self) -> None:
        coerce_fields(self, lambda key: f"sparse configuration {key}")


class GSA(BlockSparseAttention):
    """GSA: SVD + max-norm block summaries (``gsa.summary.SummaryOptions``: rank
    ``head_dim / 4``, a basis fitted to the prompt's keys and queries by default).

    With ``offload: true`` (and a ``store`` plus the ``platform`` that knows the KV cache's
    memory), a request whose prompt exceeds its device share keeps only
    ``sink + recent + cache_blocks`` blocks per layer on the device; the rest live in the
    store (``gsa.offload``). Offloaded requests always decode sparse, select one step
    ahead (``select_ahead`` is implied) and prefetch that selection while the step runs.
    """

    name = "gsa"
    scorer_name = "gsa"
    plugin_options = OffloadOptions

    def __init__(
        self,
        model: ModelSpec,
        config: Mapping[str, Any] | None = None,
        store: Store | None = None,
        platform: Any = None,
    ) -> None:
        super().__init__(model, config)
        assert isinstance(self.options, OffloadOptions)
        self.offload = self.options.offload
        if self.offload:
            self.cfg = dataclasses.replace(self.cfg, select_ahead=True)
        self.store, self.platform = store, platform
        self.offload_stats = OffloadStats()
        self._wrapped: dict[int, Any] = {}
        if not self.offload:
            return
        sel = self.cfg.selection
        if sel.allocation != "head":
            raise ValueError("offload needs allocation='head' (device slots are sized per KV head)")
        if store is None or platform is None:
            raise ValueError("offload needs a store and the platform that knows the KV cache memory")
        if sel.budget_tokens is None:
            raise ValueError("offload needs an absolute budget_tokens (device slots are sized from it)")
        if self.cfg.dense_layers:
            raise ValueError("offload cannot keep dense_layers: offloaded blocks are not on the device")
        free = max(sel.budget_tokens // model.block_size - sel.sink_blocks - sel.recent_blocks, 1)
        cache_blocks = self.options.cache_blocks
        self.cache_blocks = 2 * free if cache_blocks is None else cache_blocks
        if self.cache_blocks < free:
            raise ValueError(f"cache_blocks ({self.cache_blocks}) must hold a selection ({free} blocks)")

    # ------------------------------------------------------------------ offload plumbing
    def _offloaded(self, request_id: str) -> bool:
        return bool(self._state(request_id).extra.get("offload"))

    def _slots_needed(self) -> int:
        sel = self.cfg.selection
        return sel.sink_blocks + sel.recent_blocks + self.cache_blocks

    def request_begin(self, request_id: str, prompt_len: int) -> None:
        super().request_begin(request_id, prompt_len)
        if self.offload and prompt_len > self._slots_needed() * self.model.block_size:
            sel = self.cfg.selection
            st = self._state(request_id)
            st.extra["offload"] = True
            st.extra["res"] = [
                Residency(
                    self.store,
                    self.platform,
                    request_id,
                    layer,
                    self.model.num_kv_heads,
                    sel.sink_blocks,
                    sel.recent_blocks,
                    self.cache_blocks,
                    self.model.block_size,
                    self.offload_stats,
                )
                for layer in range(self.model.num_layers)
            ]

    def request_finished(self, request_id: str) -> None:
        st = self._requests.get(request_id)
        if st is not None:
            for res in st.extra.get("res", ()):
                res.close()
        super().request_finished(request_id)

    def estimate_num_slots(self, request_id: str, num_tokens: int) -> int:
        if request_id in self._requests and self._offloaded(request_id):
            return self._slots_needed()
        return super().estimate_num_slots(request_id, num_tokens)

    def build_sparse_meta(self, batch: StepBatch, attn: AttentionMetadata) -> SparseMeta:
        meta = super().build_sparse_meta(batch, attn)
        if not self.offload:
            return meta
        modes = list(meta.modes)
        bs = self.model.block_size
        for i, rid in enumerate(batch.request_ids):
            st = self._state(rid)
            if not st.extra.get("offload"):
                continue
            res0: Residency = st.extra["res"][0]
            seq, n = batch.seq_lens[i], batch.num_new[i]
            pos = torch.arange(seq - n, seq)
            blocks = pos // bs
            nb = -(-seq // bs)
            keep = (blocks < res0.sink) | (blocks >= nb - res0.recent)
            slot = torch.tensor([res0.slot_of(int(b)) for b in blocks.tolist()], dtype=torch.int64)
            phys = attn.block_tables[i][0][slot]
            mapping = torch.stack([phys, pos % bs], dim=1)
            mapping[~keep] = -1
            attn.slot_mapping[i] = mapping
            if n == 1 and (seq - 1) % bs == 0:  # a new block starts in a ring slot
                for res in st.extra["res"]:
                    res.before_write(int(blocks[0]))
            if batch.is_decode(i):
                modes[i] = (AttnMode.SPARSE,) * self.model.num_layers
        return SparseMeta(batch=meta.batch, modes=tuple(modes), step=meta.step)

    def layer_starting(
        self, layer: int, key: torch.Tensor, value: torch.Tensor, kv: LayerKV, meta: SparseMeta
    ) -> None:
        if not self.offload:
            return
        self._wrap(kv)
        for i, (t0, t1) in enumerate(self._token_ranges(meta.batch)):
            st = self._state(meta.batch.request_ids[i])
            if st.extra.get("offload") and t1 - t0 > 1:
                st.extra["res"][layer].dump_prompt(key[t0:t1].transpose(0, 1), value[t0:t1].transpose(0, 1))

    def layer_finishing(self, layer: int, kv: LayerKV, attn: AttentionMetadata, meta: SparseMeta) -> None:
        if not self.offload:
            return
        for i, rid in enumerate(meta.batch.request_ids):  # blocks completed by this step's token
            st = self._state(rid)
            seq = meta.batch.seq_lens[i]
            if st.extra.get("offload") and meta.batch.is_decode(i) and seq % self.model.block_size == 0:
                st.extra["res"][layer].dump_block(
                    kv, attn.saved.get(i, (attn.block_tables[i],))[0][0], seq // self.model.block_size - 1
                )

    def place(self, slot: Slot, logical: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not slot.st.extra.get("offload"):
            return super().place(slot, logical)
        res: Residency = slot.st.extra["res"][slot.layer]
        slots = slot.attn.block_tables[slot.i][0]
        nb = -(-slot.seq // self.model.block_size)
        sink, recent = forced_blocks(nb, self.cfg.selection)
        free = logical[:, sink : logical.shape[1] - recent]
        ring = logical[:, logical.shape[1] - recent :]
        ring_slots = res.sink + ring % res.recent
        physical = torch.cat(
            [slots[logical[:, :sink]], res.ensure(slot.kv, slots, free), slots[ring_slots]], dim=1
        )
        return physical, lens_of(logical, slot.seq, self.model.block_size)

    def ahead_selected(self, slot: Slot, ls: LayerState) -> None:
        if slot.st.extra.get("offload") and ls.ahead is not None and ls.free is not None:
            table = slot.attn.block_tables[slot.i][0]
            slot.st.extra["res"][slot.layer].prefetch(slot.kv, table, ls.ahead, ls.free)

    def stats(self) -> dict[str, float]:
        out = super().stats()
        if self.offload:
            o = self.offload_stats
            out.update(
                demand_blocks=float(o.demand_blocks),
                prefetched_blocks=float(o.prefetched_blocks),
                prefetch_hits=float(o.prefetch_hits),
                resident_hits=float(o.resident_hits),
                dumped_blocks=float(o.dumped_blocks),
                h2d_bytes=float(o.h2d_bytes),
                d2h_bytes=float(o.d2h_bytes),
            )
        return out

    def _wrap(self, kv: LayerKV) -> None:
        """Make the engine's cache tensors addressable by the store's platform (once)."""
        for t in (kv.k, kv.v):
            if t.data_ptr() not in self._wrapped:
                self._wrapped[t.data_ptr()] = self.platform.wrap(t, "hbm")

    def close(self) -> None:
        for st in self._requests.values():
            for res in st.extra.get("res", ()):
                res.close()
        for buf in self._wrapped.values():
            self.platform.free(buf)
        self._wrapped.clear()


__all__ = ["GSA", "OffloadOptions"]
