"""The Delegator: one contiguous transfer per KV block instead of one per scattered piece.

A block of a paged KV cache is many small pieces (one or two per layer, see
``kv_layout.py``). Handing a store ``m`` pieces per block costs it ``m`` copies (or file
writes, or RPC descriptors) per block. With the Delegator on, a dump first *gathers*
each block's pieces into one contiguous staging slot with the platform's batched copy
(one submission for the whole batch, on a copy stream, after the compute event), and
the store gets one piece per block; a load is the reverse (the store fills the slots,
then one batched copy *scatters* them into the KV cache). Off, the store is handed the
pieces themselves, which is what the switch is for: comparing the two.

Layer-wise transfers use store shards: shard ``l`` of a block is layer ``l`` (so a
layer can be loaded while earlier layers compute, and dumped right after it is
written). A slot holds the whole block either way; layer ``l`` lives at its byte offset.

Contract (call order, ownership, threads):

* ``store_layout(layout, enabled, layerwise)`` is the :class:`StoreLayout` the store must
  be built with for this Delegator.
* ``dump(ids, blocks, after=None, layer=None) -> DumpOp``; ``load(ids, blocks,
  layer=None) -> LoadOp``. ``ids`` are ``(n, 16)`` block ids, ``blocks`` the engine's
  block indices. The KV cache memory must stay untouched by the engine until
  ``DumpOp.released()`` (enabled: the gather finished; off: the store finished reading),
  and must not be read until ``LoadOp.wait()`` returned.
* A ``DumpOp`` / ``LoadOp`` is a :class:`kvfabric.status.Handle`: ``check()`` never
  blocks; ``wait(timeout=None)`` returns the per-block :class:`~kvfabric.status.ItemStatus`
  array (a load scatters only the blocks whose status is ``OK``), and raises
  ``TimeoutError`` if ``timeout`` passes first, the op going on and waitable again;
  ``cancel()`` stops what has not started (``kvfabric.status.wait_or_cancel(op, t)``:
  a deadline, then cancel, the stopped blocks reading ``TIMEOUT``). Each op returns its
  statuses once (a second ``wait`` is a ``ValueError``); one consumer waits or cancels
  it. The Delegator is the only consumer of the store tasks it creates.
* Staging slots are reused: when a dump finds too few free slots, it first finishes the
  oldest dumps in flight. All methods are thread-safe. ``close()`` finishes what is in
  flight and frees the staging memory.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from kvfabric.platform.base import Platform
from kvfabric.platform.stream import Event
from kvfabric.platform.types import CopyBatch, Medium
from kvfabric.status import ItemStatus
from kvfabric.ucm_layer.kv_layout import KVLayout
from kvfabric.ucm_layer.store.base import Store, StoreLayout, Task, check_ids


@dataclass
class _Chunk:
    """One store task over ``rows`` of an op, with the staging slots it holds."""

    rows: slice
    slots: np.ndarray  # slot indices (empty when the Delegator is off)
    task: Task | None = None
    gathered: Event | None = None
    status: np.ndarray | None = None  # set once the store task was waited


@dataclass
class _Op:
    """A dump or load in flight: a :class:`kvfabric.status.Handle` (see the module docstring)."""

    delegator: Delegator
    kind: str
    ids: np.ndarray
    blocks: np.ndarray
    layer: int | None
    chunks: list[_Chunk] = field(default_factory=list)
    waited: bool = False

    @property
    def num_blocks(self) -> int:
        return int(self.blocks.size)

    def check(self) -> bool:
        """Whether every store task of this op has finished (never blocks)."""
        return all(c.status is not None or (c.task is not None and c.task.check()) for c in self.chunks)

    def done(self) -> bool:
        """Deprecated: ``check()``."""
        warnings.warn("DumpOp/LoadOp.done() is deprecated: use check()", DeprecationWarning, stacklevel=2)
        return self.check()

    def wait(self, timeout: float | None = None) -> np.ndarray:
        """The per-block statuses once every block finished; ``TimeoutError`` (the op goes on
        and may be waited again) if ``timeout`` seconds pass first. Once only."""
        return self.delegator._wait(self, timeout)

    def cancel(self) -> None:
        """Stop what has not started; a following ``wait`` returns at once (the blocks
        the cancel stopped read ``CANCELLED``)."""
        self.delegator._cancel(self)


class DumpOp(_Op):
    def released(self) -> bool:
        """Whether the engine may reuse the source KV blocks (never blocks)."""
        if not self.delegator.enabled:
            return self.check()
        return all(c.gathered is None or c.gathered.query() for c in self.chunks)


class LoadOp(_Op):
    pass


OpT = TypeVar("OpT", bound=_Op)


class Delegator:
    """Gather/scatter between a paged KV cache and a store (see the module docstring)."""

    def __init__(
        self,
        platform: Platform,
        layout: KVLayout,
        store: Store,
        *,
        enabled: bool = True,
        layerwise: bool = False,
        staging_blocks: int = 128,
        staging_medium: Medium = Medium.HBM,
    ) -> None:
        if staging_blocks < 1:
            raise ValueError(f"staging_blocks must be >= 1, got {staging_blocks}")
        want = self.store_layout(layout, enabled, layerwise)
        if store.layout != want:
            raise ValueError(f"the store was built with {store.layout}, this Delegator needs {want}")
        self.platform, self.layout, self.store = platform, layout, store
        self.enabled, self.layerwise = bool(enabled), bool(layerwise)
        self._lock = threading.RLock()
        self._slots_free = threading.Condition(self._lock)
        self._inflight: deque[tuple[DumpOp, _Chunk]] = deque()
        # byte offset of each piece inside a slot, and of each layer's first piece
        self._piece_off = np.concatenate([[0], np.cumsum(layout.size)[:-1]]).astype(np.uint64)
        self._staging = None
        self._stream = None
        if self.enabled:
            self.slot_bytes = layout.block_bytes
            self._staging = platform.alloc(self.slot_bytes * staging_blocks, staging_medium)
            try:  # fault the staging pages in now, not on the first transfers
                self._staging.numpy()[:] = 0
            except (ValueError, TypeError, NotImplementedError, RuntimeError):
                pass  # device memory: nothing to pre-touch from the host
            self._free = list(range(staging_blocks - 1, -1, -1))
            self._stream = platform.stream()
        self.staging_blocks = staging_blocks

    # ------------------------------------------------------------------ layouts
    @staticmethod
    def store_layout(layout: KVLayout, enabled: bool, layerwise: bool) -> StoreLayout:
        """The store layout this Delegator hands its store (shards = layers if layer-wise)."""
        if layerwise:
            if not layout.uniform_layers():
                raise ValueError("layer-wise transfers need every layer to have the same piece sizes")
            a, b = layout.layer_slices[0]
            pieces = (layout.layer_bytes(0),) if enabled else tuple(int(s) for s in layout.size[a:b])
            return StoreLayout(pieces, num_shards=layout.num_layers)
        return StoreLayout((layout.block_bytes,) if enabled else layout.piece_sizes, num_shards=1)

    def _cols(self, layer: int | None) -> slice:
        return slice(None) if layer is None else slice(*self.layout.layer_slices[layer])

    def _shard(self, layer: int | None) -> int:
        if self.layerwise != (layer is not None):
            raise ValueError(
                "this Delegator is layer-wise: pass layer="
                if self.layerwise
                else "layer given to a whole-block Delegator"
            )
        if layer is not None and not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer {layer} out of range (0..{self.layout.num_layers - 1})")
        return 0 if layer is None else int(layer)

    def _slot_addrs(self, slots: np.ndarray, layer: int | None) -> np.ndarray:
        assert self._staging is not None
        off = 0 if layer is None else int(self._piece_off[self.layout.layer_slices[layer][0]])
        base = np.uint64(self._staging.ptr + off)
        return (base + slots.astype(np.uint64) * np.uint64(self.slot_bytes)).reshape(-1, 1)

    def _copy_batch(
        self, blocks: np.ndarray, slots: np.ndarray, layer: int | None, to_slots: bool
    ) -> CopyBatch:
        cols = self._cols(layer)
        pieces = self.layout.addrs(blocks)[:, cols]
        staged = (
            np.uint64(self._staging.ptr)  # type: ignore[union-attr]
            + slots.astype(np.uint64)[:, None] * np.uint64(self.slot_bytes)
            + self._piece_off[cols][None, :]
        )
        sizes = np.broadcast_to(self.layout.size[cols][None, :], pieces.shape).reshape(-1)
        if to_slots:
            return CopyBatch(staged.reshape(-1), pieces.reshape(-1), sizes)
        return CopyBatch(pieces.reshape(-1), staged.reshape(-1), sizes)

    # ------------------------------------------------------------------ slots
    def _take_slots(self, k: int) -> np.ndarray:
        """``k`` free slots, finishing the oldest dumps in flight until there are enough."""
        with self._lock:
            while len(self._free) < k:
                if self._inflight:
                    op, chunk = self._inflight[0]
                    self._finish_dump_chunk(op, chunk, None)
                    continue
                self._slots_free.wait(0.05)  # loads of other threads hold them
            return np.array([self._free.pop() for _ in range(k)], np.int64)

    def _give_slots(self, slots: np.ndarray) -> None:
        if slots.size:
            with self._lock:
                self._free.extend(int(s) for s in slots)
                self._slots_free.notify_all()

    def _checked(self, ids: Any, blocks: Any, layer: int | None) -> tuple[np.ndarray, np.ndarray, int]:
        """Validated ``(ids, blocks, store shard)`` of a dump or load."""
        ids = check_ids(ids)
        blocks = self.layout.check_blocks(blocks)
        if ids.shape[0] != blocks.size:
            raise ValueError(f"{ids.shape[0]} ids for {blocks.size} blocks")
        return ids, blocks, self._shard(layer)

    # ------------------------------------------------------------------ dump
    def dump(self, ids: Any, blocks: Any, after: Event | None = None, layer: int | None = None) -> DumpOp:
        """Start storing the KV of ``blocks`` under ``ids`` once ``after`` completed."""
        ids, blocks, shard = self._checked(ids, blocks, layer)
        op = DumpOp(self, "dump", ids, blocks, layer)
        if not blocks.size:
            return op
        if not self.enabled:
            return self._direct(op, lambda addrs: self.store.dump(ids, shard, addrs, after=after))
        step = self.staging_blocks
        for start in range(0, blocks.size, step):
            rows = slice(start, min(start + step, blocks.size))
            chunk = _Chunk(rows, self._take_slots(rows.stop - rows.start))
            try:
                assert self._stream is not None
                if after is not None:
                    self._stream.wait_event(after)
                self.platform.batch_copy(
                    self._copy_batch(blocks[rows], chunk.slots, layer, True), self._stream
                )
                chunk.gathered = self.platform.event()
                chunk.gathered.record(self._stream)
                chunk.task = self.store.dump(
                    ids[rows], shard, self._slot_addrs(chunk.slots, layer), after=chunk.gathered
                )
            except BaseException:
                self._give_slots(chunk.slots)
                for c in op.chunks:  # already submitted chunks finish normally
                    self._finish_dump_chunk(op, c, None)
                raise
            op.chunks.append(chunk)
            with self._lock:
                self._inflight.append((op, chunk))
        return op

    def _finish_dump_chunk(self, op: DumpOp, chunk: _Chunk, timeout: float | None) -> None:
        with self._lock:
            if chunk.status is not None:
                return
            assert chunk.task is not None
            chunk.status = self.store.wait(chunk.task, timeout)
            try:
                self._inflight.remove((op, chunk))
            except ValueError:
                pass
            self._give_slots(chunk.slots)

    def _direct(self, op: OpT, start: Callable[[np.ndarray], Task]) -> OpT:
        """The Delegator off: one store task over the KV pieces themselves."""
        chunk = _Chunk(slice(0, op.num_blocks), np.empty(0, np.int64))
        chunk.task = start(self.layout.addrs(op.blocks)[:, self._cols(op.layer)])
        op.chunks.append(chunk)
        return op

    # ------------------------------------------------------------------ load
    def load(self, ids: Any, blocks: Any, layer: int | None = None) -> LoadOp:
        """Start loading ``ids`` into ``blocks``; the bytes are in place after ``wait``."""
        ids, blocks, shard = self._checked(ids, blocks, layer)
        op = LoadOp(self, "load", ids, blocks, layer)
        if not blocks.size:
            return op
        if not self.enabled:
            return self._direct(op, lambda addrs: self.store.load(ids, shard, addrs))
        step = self.staging_blocks
        for start in range(0, blocks.size, step):
            op.chunks.append(_Chunk(slice(start, min(start + step, blocks.size)), np.empty(0, np.int64)))
        self._issue_loads(op, shard, limit=len(op.chunks))
        return op

    def _issue_loads(self, op: LoadOp, shard: int, limit: int) -> None:
        """Issue up to ``limit`` not yet issued chunks while slots are free (the first
        one always: it may wait for slots)."""
        issued = 0
        for c in op.chunks:
            if c.task is not None or c.status is not None:
                continue
            if issued >= limit:
                return
            k = c.rows.stop - c.rows.start
            if issued and len(self._free) < k:
                return
            c.slots = self._take_slots(k)
            try:
                c.task = self.store.load(op.ids[c.rows], shard, self._slot_addrs(c.slots, op.layer))
            except BaseException:
                self._give_slots(c.slots)
                c.slots = np.empty(0, np.int64)
                raise
            issued += 1

    def _collect_load(self, op: LoadOp, c: _Chunk) -> None:
        """Take the statuses of a finished load chunk, scatter its ``OK`` blocks, free its slots."""
        assert c.task is not None
        try:
            c.status = self.store.wait(c.task)
            if self.enabled:
                good = np.flatnonzero(c.status == ItemStatus.OK)
                if good.size:
                    blocks = op.blocks[c.rows][good]
                    self.platform.batch_copy(self._copy_batch(blocks, c.slots[good], op.layer, False))
        finally:
            self._give_slots(c.slots)
            c.slots = np.empty(0, np.int64)

    def _finish(self, op: _Op, c: _Chunk) -> None:
        if isinstance(op, DumpOp):
            self._finish_dump_chunk(op, c, None)
        else:
            self._collect_load(op, c)

    def _wait(self, op: _Op, timeout: float | None) -> np.ndarray:
        if op.waited:
            raise ValueError(f"this {op.kind} was already waited for")
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must be >= 0 seconds or None, got {timeout}")
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            for c in op.chunks:
                if c.status is not None:
                    continue
                if c.task is None:  # a load chunk not issued yet (slots were short)
                    assert isinstance(op, LoadOp)
                    self._issue_loads(op, 0 if op.layer is None else op.layer, limit=1)
                assert c.task is not None
                left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                if not c.task.wait_finished(left):
                    raise TimeoutError(
                        f"{op.kind} of {op.num_blocks} block(s) not finished after {timeout} s"
                    )
                self._finish(op, c)
        except TimeoutError:
            raise
        except BaseException:
            self._cancel(op)  # an error part-way: cancel and release the rest
            raise
        op.waited = True
        out = np.empty(op.num_blocks, np.int8)
        for c in op.chunks:
            out[c.rows] = c.status
        return out

    def _cancel(self, op: _Op) -> None:
        """Cancel the store tasks of ``op`` that are not collected, collect them, and mark
        the chunks never issued ``CANCELLED``."""
        for c in op.chunks:
            if c.status is not None:
                continue
            if c.task is None:
                c.status = np.full(c.rows.stop - c.rows.start, ItemStatus.CANCELLED, np.int8)
                continue
            self.store.cancel(c.task)
            self._finish(op, c)

    # ------------------------------------------------------------------ lifecycle
    def drain(self) -> None:
        """Finish every dump in flight (their ops keep their statuses for ``wait``)."""
        while True:
            with self._lock:
                if not self._inflight:
                    return
                op, chunk = self._inflight[0]
                self._finish_dump_chunk(op, chunk, None)

    def close(self) -> None:
        """Finish dumps in flight and free the staging memory. Idempotent."""
        self.drain()
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        if self._staging is not None and not self._staging.freed and not self.platform.closed:
            self.platform.free(self._staging)
        self._staging = None
