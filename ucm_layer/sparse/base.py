"""The sparse-attention plugin contract (``UcmSparseBase``) and the registry of algorithms.

An engine (vLLM's model runner, or the small torch engine of the evaluation harness)
calls one plugin instance through these hooks, in this order:

scheduler side, per request
    ``request_begin(request_id, prompt_len)`` when the request is admitted;
    ``estimate_num_slots(request_id, num_tokens)`` whenever the engine sizes the
    request's device blocks (a sparse request with offload needs fewer than
    ``ceil(num_tokens / block_size)``);
    ``request_finished(request_id)`` when it ends (frees every per-request state).

worker side, per step
    ``build_sparse_meta(batch, attn)`` once, before the forward: decides dense or sparse per
    request and layer (the adaptive switch), and may rewrite ``attn.slot_mapping`` (where
    the new tokens' keys and values are written) for requests whose blocks it manages.
    Then for every layer ``l``:
    the engine writes the step's new keys/values into the paged cache, then
    ``attention_begin(l, query, key, value, kv, attn, meta)``: may replace, for sparse
    requests, the block table, block lengths and sequence length that the attention kernel
    sees (``attn.block_tables[i]`` etc.); the engine runs attention on ``attn``;
    ``attention_finished(l, query, key, value, output, kv, attn, meta)``: restores every
    entry it replaced and updates its own state (block summaries of newly written keys,
    selections for the next step, prefetch);
    ``execute_finished(meta)`` once after the forward.

Memory ownership: the engine owns the paged KV cache (:class:`LayerKV`) and the
:class:`AttentionMetadata`; a plugin may read the cache, may write only the blocks the
engine handed to it through ``estimate_num_slots`` for requests it manages with offload, and
mutates ``AttentionMetadata`` only between ``attention_begin`` and ``attention_finished``
(plus ``slot_mapping`` in ``build_sparse_meta``). Tensors stay on the device the KV lives on;
no hook moves per-step data to the host except what a store transfer needs.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvfabric.registry import Registry

if TYPE_CHECKING:
    import torch


class AttnMode(enum.Enum):
    """How one request's attention runs in one layer this step."""

    DENSE = "dense"
    SPARSE = "sparse"


@dataclass(frozen=True)
class ModelSpec:
    """The attention geometry a plugin is built for."""

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_q_heads", "num_kv_heads", "head_dim", "block_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"ModelSpec.{name} must be a positive int, got {v!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads ({self.num_q_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads


@dataclass(frozen=True)
class StepBatch:
    """The requests of one forward step, in batch order.

    ``seq_lens[i]`` counts the tokens of request ``i`` in the KV cache once this step's new
    tokens are written; ``num_new[i]`` is how many of them this step computes (the prompt
    length at prefill, 1 at decode)."""

    request_ids: tuple[str, ...]
    seq_lens: tuple[int, ...]
    num_new: tuple[int, ...]

    def __post_init__(self) -> None:
        n = len(self.request_ids)
        if len(self.seq_lens) != n or len(self.num_new) != n:
            raise ValueError(
                f"StepBatch fields differ in length: {n} ids, {len(self.seq_lens)} seq_lens, "
                f"{len(self.num_new)} num_new"
            )
        for i, (s, k) in enumerate(zip(self.seq_lens, self.num_new)):
            if k < 1 or s < k:
                raise ValueError(f"request {self.request_ids[i]!r}: need 1 <= num_new ({k}) <= seq_len ({s})")

    def is_decode(self, i: int) -> bool:
        return self.num_new[i] == 1 and self.seq_lens[i] > 1


@dataclass
class LayerKV:
    """One layer's paged cache, owned by the engine: ``k``/``v`` are
    ``(num_kv_heads, num_blocks, block_size, head_dim)``, so the keys of one (head, block)
    are contiguous and a request whose blocks are consecutive is a free dense view."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def num_blocks(self) -> int:
        return int(self.k.shape[1])

    @property
    def block_size(self) -> int:
        return int(self.k.shape[2])


@dataclass
class AttentionMetadata:
    """What the attention kernel reads, per request (mutable: plugins swap entries).

    ``block_tables[i]``: int64 ``(H, n)`` with ``H`` 1 (one table for every KV head) or the
    number of KV heads (a table per head); entries are physical block indices.
    ``block_lens[i]``: int64, same shape: valid tokens in each listed block (0 = padding).
    ``seq_lens[i]``: tokens the kernel attends to (per head, the sum of ``block_lens``).
    ``slot_mapping[i]``: int64 ``(num_new, 2)`` (physical block, offset) where this step's
    new tokens are written."""

    block_tables: list[torch.Tensor]
    block_lens: list[torch.Tensor]
    seq_lens: list[int]
    slot_mapping: list[torch.Tensor]
    saved: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = field(default_factory=dict)

    def replace(self, i: int, block_table: torch.Tensor, block_lens: torch.Tensor, seq_len: int) -> None:
        """Swap request ``i``'s view (the original is kept for :meth:`restore`)."""
        if i in self.saved:
            raise ValueError(f"request slot {i} is already replaced; restore it first")
        self.saved[i] = (self.block_tables[i], self.block_lens[i], self.seq_lens[i])
        self.block_tables[i], self.block_lens[i], self.seq_lens[i] = block_table, block_lens, seq_len

    def restore(self) -> None:
        for i, (t, ln, s) in self.saved.items():
            self.block_tables[i], self.block_lens[i], self.seq_lens[i] = t, ln, s
        self.saved.clear()


@dataclass(frozen=True)
class SparseMeta:
    """What ``build_sparse_meta`` decided for one step: the mode of every (request, layer)."""

    batch: StepBatch
    modes: tuple[tuple[AttnMode, ...], ...]  # [request][layer]
    step: int

    def mode(self, i: int, layer: int) -> AttnMode:
        return self.modes[i][layer]


class UcmSparseBase(abc.ABC):
    """A sparse-attention algorithm behind the engine hooks (call order: module docstring)."""

    name: str = "abstract"

    def __init__(self, model: ModelSpec, config: Mapping[str, Any] | None = None) -> None:
        if not isinstance(model, ModelSpec):
            raise TypeError(f"model must be a ModelSpec, got {type(model).__name__}")
        self.model = model
        self.config = dict(config or {})

    def request_begin(self, request_id: str, prompt_len: int) -> None:
        """A request was admitted with ``prompt_len`` prompt tokens."""

    def request_finished(self, request_id: str) -> None:
        """The request ended: drop its state (idempotent)."""

    def estimate_num_slots(self, request_id: str, num_tokens: int) -> int:
        """Device blocks the request needs to hold ``num_tokens`` tokens (dense: all)."""
        return -(-int(num_tokens) // self.model.block_size)

    @abc.abstractmethod
    def build_sparse_meta(self, batch: StepBatch, attn: AttentionMetadata) -> SparseMeta: ...

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
        """Before layer ``layer``'s attention; ``query`` is ``(tokens, num_q_heads, head_dim)``
        for the whole batch, ``key``/``value`` the new tokens' (already in the cache)."""

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
        """After layer ``layer``'s attention: restore ``attn`` and update state."""
        attn.restore()

    def execute_finished(self, meta: SparseMeta) -> None:
        """After the forward of the step described by ``meta``."""

    def stats(self) -> dict[str, float]:
        """Counters for reports (selections made, reuse, bytes moved...)."""
        return {}

    def close(self) -> None:
        """Wait for or cancel outstanding transfers; idempotent."""


#: algorithm name -> "module:Class", imported only when created (plugins: the
#: ``kvfabric.sparse_algorithms`` entry-point group)
ALGORITHMS: Registry[type[UcmSparseBase]] = Registry(
    "sparse algorithm",
    {
        "dense": "kvfabric.ucm_layer.sparse.dense:DenseAttention",
        "gsa": "kvfabric.ucm_layer.sparse.gsa.plugin:GSA",
        "quest": "kvfabric.ucm_layer.sparse.baselines.plugins:Quest",
        "meankey": "kvfabric.ucm_layer.sparse.baselines.plugins:MeanKey",
        "hata": "kvfabric.ucm_layer.sparse.baselines.plugins:Hata",
        "oracle": "kvfabric.ucm_layer.sparse.baselines.plugins:Oracle",
    },
    kind=UcmSparseBase,
)


def register(name: str, target: str) -> None:
    """Register an out-of-tree algorithm as ``"package.module:Class"``."""
    if not isinstance(target, str) or ":" not in target:
        raise ValueError(f"target must look like 'package.module:Class', got {target!r}")
    ALGORITHMS.register(name, target, replace=True)


def create(name: str, model: ModelSpec, config: Mapping[str, Any] | None = None, **kwargs: Any) -> Any:
    """Build the algorithm registered as ``name``; its configuration is validated here."""
    return ALGORITHMS.create(name, model, config, **kwargs)


__all__ = [
    "ALGORITHMS",
    "AttentionMetadata",
    "AttnMode",
    "LayerKV",
    "ModelSpec",
    "SparseMeta",
    "StepBatch",
    "UcmSparseBase",
    "create",
    "register",
]
