"""Several KV cache groups (vLLM's hybrid KV cache manager): the hit rule, the per-group
transfers and the per-group KV layouts.

A hybrid model has one KV cache group per kind of attention layer; ``windows`` gives each
group's sliding window in tokens (None: full attention). Every group's blocks are stored
under the same chained ids stamped with the group (``hashing.tag``), one transfer per
request and group.

* Hit rule (:func:`hit_blocks`, the scheduler's lookup): a prefix of ``H`` blocks beyond
  vLLM's own prefix hit ``local`` hits when every full-attention group holds blocks
  ``[0, H)`` and every sliding-window group the blocks covering tokens
  ``[max(0, H*bs - W + 1), H*bs)`` (the ones vLLM keeps; those before are its null block
  :data:`NULL_BLOCK`).
* Transfers (:func:`group_transfers`, the scheduler's plan): one per group over the
  group's non-null engine blocks; dumps of sliding-window groups are ``transient`` (vLLM
  frees those blocks while the request runs, so the worker waits until the dump released
  them).
* Layouts (:func:`group_layouts`, the worker's ``register``): one :class:`KVLayout` per
  group over its layers' tensors (views of one allocation), next to the layout of all of
  them in group order.

Pure functions on plain values: nothing here keeps state or touches memory; callers own
every array they pass and get new ones back. Thread-safe.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from kvfabric.ucm_layer.connector.plan import Transfer
from kvfabric.ucm_layer.kv_layout import KVLayout, layout_from_tensors

NULL_BLOCK = 0  # vLLM's null block: a sliding-window position outside the window
PresentFn = Callable[[np.ndarray, int], np.ndarray]  # (base ids, group) -> present per block


def hit_blocks(
    tail: np.ndarray,
    local: int,
    limit: int,
    windows: Sequence[int | None],
    block_size: int,
    present: PresentFn,
) -> int:
    """The most blocks of ``tail`` (the base ids after vLLM's ``local`` blocks), at most
    ``limit``, that hit by the rule of the module docstring; ``present(ids, group)`` asks
    the store which blocks of a group it holds."""
    n = min(tail.shape[0], max(limit, 0))
    if n <= 0:
        return 0
    tail = tail[:n]
    windowed: dict[int, np.ndarray] = {}
    for g, w in enumerate(windows):
        held = np.asarray(present(tail, g), bool).reshape(-1)[:n]
        if w is None:
            missing = np.flatnonzero(~held)
            n = min(n, int(missing[0]) if missing.size else held.size)
        else:
            windowed[g] = held
    for h in range(n, 0, -1):
        end = local + h
        if all(
            p[max(local, max(0, end * block_size - int(windows[g]) + 1) // block_size) - local : h].all()
            for g, p in windowed.items()
        ):
            return h
    return 0


def group_transfers(
    req_id: str,
    ids: np.ndarray,
    group_blocks: Sequence[np.ndarray],
    num_tokens: int,
    block_size: int,
    windows: Sequence[int | None],
    *,
    dump: bool,
) -> list[Transfer]:
    """One transfer per group of ``ids`` into (or out of) that group's engine blocks
    (``group_blocks[g]``, one per id), leaving out null blocks; a group with none left has
    no transfer. ``dump``: sliding-window groups' transfers are ``transient``."""
    out: list[Transfer] = []
    for g, blocks in enumerate(group_blocks):
        keep = blocks != NULL_BLOCK
        if keep.any():
            transient = dump and windows[g] is not None
            out.append(Transfer(req_id, ids[keep], blocks[keep], num_tokens, block_size, g, transient))
    return out


def group_layouts(
    kv_caches: Mapping[str, Any],
    groups: Sequence[Sequence[str]],
    num_blocks: int,
    block_strides: Mapping[str, int] | None = None,
) -> tuple[KVLayout, list[KVLayout]]:
    """The layout of every group's layers (in group order) and one layout per group;
    ``ValueError`` naming the layers ``kv_caches`` has no tensors for."""
    missing = [n for names in groups for n in names if n not in kv_caches]
    if missing:
        raise ValueError(f"kvfabric: no KV cache tensors for the layers {missing}")
    ordered = {n: kv_caches[n] for names in groups for n in names}
    whole = layout_from_tensors(ordered, num_blocks, block_strides)
    parts = [
        layout_from_tensors({n: kv_caches[n] for n in names}, num_blocks, block_strides) for names in groups
    ]
    return whole, parts
