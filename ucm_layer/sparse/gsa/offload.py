"""Offload of unselected blocks to a store, with prefetch of the next step's selection.

For an offloaded request the engine holds only ``sink + recent + cache`` device blocks per
layer (``estimate_num_slots``), handed to the plugin as the request's block list ``P``:

* slots ``[0, sink)`` keep the sink blocks;
* slots ``[sink, sink + recent)`` are a ring holding the most recent blocks (logical block
  ``b`` in slot ``sink + b % recent``); new tokens are written there, and a block is dumped
  to the store as soon as it is complete, before its ring slot is reused;
* slots ``[sink + recent, ...)`` are a per-KV-head cache of selected blocks, filled from
  the store: blocks the step needs and lacks are loaded on demand (``ensure``), blocks
  selected ahead for the next step are loaded while this step runs (``prefetch``);
  eviction is least-recently-used among blocks neither step needs.

At prefill every complete prompt block (but the sink) is dumped from a staging copy. A
store object is one (request, layer, KV head, block): its id is ``request key (8 bytes) |
layer (u16) | head (u16) | block (u32)`` and its two pieces are the head's K and V rows of
the block (contiguous in the ``(H, num_blocks, bs, D)`` cache). The residency maps are
host-side: issuing a store transfer is a host action, once per layer and step; scoring,
top-k and the gather stay on the device.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvfabric.errors import TransferFailed
from kvfabric.ucm_layer.sparse.base import LayerKV
from kvfabric.ucm_layer.store.base import BlockStatus, Store, StoreLayout, Task


def request_key(request_id: str) -> bytes:
    return hashlib.blake2b(request_id.encode(), digest_size=8).digest()


def block_ids(req: bytes, layer: int, heads: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """``(n, 16)`` uint8 store ids of (head, block) pairs of one (request, layer)."""
    n = len(heads)
    out = np.zeros((n, 16), np.uint8)
    out[:, :8] = np.frombuffer(req, np.uint8)
    out[:, 8:10] = np.frombuffer(np.uint16(layer).tobytes(), np.uint8)
    out[:, 10:12] = heads.astype("<u2").view(np.uint8).reshape(n, 2)
    out[:, 12:16] = blocks.astype("<u4").view(np.uint8).reshape(n, 4)
    return out


def store_layout(block_size: int, head_dim: int, element_size: int) -> StoreLayout:
    """Two pieces per object: the K rows and the V rows of one (head, block)."""
    piece = block_size * head_dim * element_size
    return StoreLayout(piece_sizes=(piece, piece))


@dataclass
class OffloadStats:
    demand_blocks: int = 0
    prefetched_blocks: int = 0
    prefetch_hits: int = 0
    resident_hits: int = 0
    dumped_blocks: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    extra: dict[str, float] = field(default_factory=dict)


class Residency:
    """Which blocks of one (request, layer) are on the device, and the transfers that move
    them (see the module docstring). Not thread-safe: one engine thread drives it."""

    def __init__(
        self,
        store: Store,
        platform: Any,
        request_id: str,
        layer: int,
        heads: int,
        sink: int,
        recent: int,
        cache: int,
        block_size: int,
        stats: OffloadStats,
    ) -> None:
        if recent < 1:
            raise ValueError("offload needs recent_blocks >= 1 (the ring where new tokens are written)")
        self.store, self.platform, self.layer = store, platform, layer
        self.req = request_key(request_id)
        self.h, self.sink, self.recent, self.cache, self.bs = heads, sink, recent, cache, block_size
        self.stats = stats
        self.loc: dict[tuple[int, int], int] = {}  # (head, block) -> cache index, resident
        self.owner = np.full((heads, cache), -1, np.int64)
        self.last_used = np.zeros((heads, cache), np.int64)
        self.unused_prefetch = np.zeros((heads, cache), bool)
        self.pending: list[tuple[Task, np.ndarray, np.ndarray, np.ndarray]] = []
        self.ring_dumps: dict[int, Task] = {}
        self.clock = 0

    @property
    def num_slots(self) -> int:
        return self.sink + self.recent + self.cache

    def slot_of(self, block: int) -> int:
        """Index into the request's block list of a sink or ring (recent) block."""
        return block if block < self.sink else self.sink + block % self.recent

    # ------------------------------------------------------------------ addresses
    def _addrs(self, kv: LayerKV, heads: np.ndarray, phys: np.ndarray) -> np.ndarray:
        nb, row = kv.num_blocks, kv.block_size * kv.k.shape[3] * kv.k.element_size()
        off = (heads.astype(np.int64) * nb + phys.astype(np.int64)) * row
        return np.stack([kv.k.data_ptr() + off, kv.v.data_ptr() + off], axis=1).astype(np.uint64)

    def _wait(self, task: Task, what: str) -> np.ndarray:
        st = self.store.wait(task)
        bad = np.flatnonzero(st != BlockStatus.OK)
        if bad.size and what:
            raise TransferFailed(
                f"{what} of layer {self.layer}: {bad.size} of {len(st)} block(s) failed "
                f"(first status {BlockStatus(int(st[bad[0]])).name})"
            )
        return st

    # ------------------------------------------------------------------ prefill / writes
    def dump_prompt(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store every complete prompt block past the sink, from ``(H, n, D)`` keys/values."""
        full = keys.shape[1] // self.bs
        if full <= self.sink:
            return
        h, d = keys.shape[0], keys.shape[2]
        ks = keys[:, self.sink * self.bs : full * self.bs].reshape(h, -1, self.bs, d).contiguous()
        vs = values[:, self.sink * self.bs : full * self.bs].reshape(h, -1, self.bs, d).contiguous()
        kb, vb = self.platform.wrap(ks), self.platform.wrap(vs)
        try:
            heads, blocks = np.divmod(np.arange(h * (full - self.sink)), full - self.sink)
            addrs = self._addrs(LayerKV(ks, vs), heads, blocks)
            ids = block_ids(self.req, self.layer, heads, blocks + self.sink)
            self._wait(self.store.dump(ids, 0, addrs), "prompt dump")
        finally:
            self.platform.free(kb)
            self.platform.free(vb)
        self.stats.dumped_blocks += len(heads)
        self.stats.d2h_bytes += len(heads) * 2 * ks[0, 0].numel() * ks.element_size()

    def before_write(self, block: int) -> None:
        """A new block starts in its ring slot: the block that was there must be stored."""
        task = self.ring_dumps.pop(self.slot_of(block), None)
        if task is not None:
            self._wait(task, "ring dump")

    def dump_block(self, kv: LayerKV, slots: torch.Tensor, block: int) -> None:
        """``block`` (in its ring slot) just became complete: store it, asynchronously."""
        phys = int(slots[self.slot_of(block)])
        heads = np.arange(self.h)
        ids = block_ids(self.req, self.layer, heads, np.full(self.h, block))
        self.ring_dumps[self.slot_of(block)] = self.store.dump(
            ids, 0, self._addrs(kv, heads, np.full(self.h, phys))
        )
        self.stats.dumped_blocks += self.h
        self.stats.d2h_bytes += self.h * 2 * self.bs * kv.k.shape[3] * kv.k.element_size()

    def _flush_dumps(self) -> None:
        for slot in list(self.ring_dumps):
            self._wait(self.ring_dumps.pop(slot), "ring dump")

    # ------------------------------------------------------------------ selection residency
    def _settle_prefetch(self) -> None:
        for task, heads, blocks, cidx in self.pending:
            st = self.store.wait(task)
            for h, b, c, s in zip(heads, blocks, cidx, st):
                if s == BlockStatus.OK:
                    self.loc[(int(h), int(b))] = int(c)
                    self.owner[h, c] = b
                    self.unused_prefetch[h, c] = True
                else:  # a failed prefetch is only a hint lost: the block loads on demand
                    self.owner[h, c] = -1
        self.pending.clear()

    def _victims(self, h: int, count: int, keep: set[int]) -> list[int]:
        free = [c for c in range(self.cache) if self.owner[h, c] < 0]
        if len(free) < count:
            busy = [
                c for c in range(self.cache) if self.owner[h, c] >= 0 and int(self.owner[h, c]) not in keep
            ]
            busy.sort(key=lambda c: self.last_used[h, c])
            free += busy[: count - len(free)]
        if len(free) < count:
            raise ValueError(
                f"offload cache of {self.cache} blocks per head cannot hold {count} more blocks; "
                "raise cache_blocks"
            )
        for c in free[:count]:
            old = int(self.owner[h, c])
            if old >= 0:
                self.loc.pop((h, old), None)
            self.owner[h, c] = -1
        return free[:count]

    def _plan(self, want: np.ndarray, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        heads, blocks, cidx = [], [], []
        for h in range(self.h):
            missing = [int(b) for b in want[h] if (h, int(b)) not in self.loc]
            if not missing:
                continue
            slots = self._victims(h, len(missing), {int(b) for b in keep[h]} | {int(b) for b in want[h]})
            for b, c in zip(missing, slots):
                heads.append(h)
                blocks.append(b)
                cidx.append(c)
                self.owner[h, c] = b  # reserved
        return np.array(heads, np.int64), np.array(blocks, np.int64), np.array(cidx, np.int64)

    def _load(
        self, kv: LayerKV, slots: torch.Tensor, heads: np.ndarray, blocks: np.ndarray, cidx: np.ndarray
    ) -> Task:
        self._flush_dumps()
        phys = slots.cpu().numpy()[self.sink + self.recent + cidx]
        ids = block_ids(self.req, self.layer, heads, blocks)
        self.stats.h2d_bytes += len(heads) * 2 * self.bs * kv.k.shape[3] * kv.k.element_size()
        return self.store.load(ids, 0, self._addrs(kv, heads, phys))

    def ensure(self, kv: LayerKV, slots: torch.Tensor, free: torch.Tensor) -> torch.Tensor:
        """Physical blocks ``(H, k_free)`` holding the selected ``free`` blocks, loading the
        missing ones now."""
        self._settle_prefetch()
        self.clock += 1
        want = free.cpu().numpy()
        heads, blocks, cidx = self._plan(want, want)
        if len(heads):
            self._wait(self._load(kv, slots, heads, blocks, cidx), "demand load")
            for h, b, c in zip(heads, blocks, cidx):
                self.loc[(int(h), int(b))] = int(c)
            self.stats.demand_blocks += len(heads)
        out = np.empty_like(want)
        for h in range(self.h):
            for j, b in enumerate(want[h]):
                c = self.loc[(h, int(b))]
                out[h, j] = c
                self.last_used[h, c] = self.clock
                if self.unused_prefetch[h, c]:
                    self.unused_prefetch[h, c] = False
                    self.stats.prefetch_hits += 1
                else:
                    self.stats.resident_hits += 1
        base = self.sink + self.recent
        return slots[torch.from_numpy(out + base).to(slots.device)]

    def prefetch(self, kv: LayerKV, slots: torch.Tensor, ahead: torch.Tensor, current: torch.Tensor) -> None:
        """Start loading the blocks of ``ahead`` (the next step's selection) that are not
        resident, into cache slots that neither ``current`` nor ``ahead`` uses."""
        self._settle_prefetch()
        heads, blocks, cidx = self._plan(ahead.cpu().numpy(), current.cpu().numpy())
        if len(heads):
            self.pending.append((self._load(kv, slots, heads, blocks, cidx), heads, blocks, cidx))
            self.stats.prefetched_blocks += len(heads)

    def close(self) -> None:
        self._settle_prefetch()
        self._flush_dumps()


__all__ = ["OffloadStats", "Residency", "block_ids", "request_key", "store_layout"]
