"""The adaptive dense/sparse switch and the validated configuration of block-sparse plugins.

Dense attention is exact and, for short sequences, no slower: a request runs sparse in a
layer only when (1) it is decoding, (2) its sequence is at least ``min_seq_len`` tokens and
longer than the budget, (3) at least ``min_long_requests`` requests of the batch qualify
(below that the batch is dominated by dense work anyway and the scoring overhead is not
repaid), (4) the qualifying requests together skip at least ``min_skipped_kv`` key
elements per layer (tokens left out times KV heads times head dim, summed over them: the
attention work sparse saves, against a selection cost that is mostly fixed per layer and
step), and (5) the layer is not listed in ``dense_layers``.

The step's decision is all or nothing over its qualifying requests, so a request's answer
can depend on what it is batched with; dense is exact, so that only ever moves it toward
the dense answer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from kvfabric.settings import coerce_fields, setting
from kvfabric.ucm_layer.sparse.base import AttnMode, StepBatch
from kvfabric.ucm_layer.sparse.selection import SelectionConfig

#: ``min_skipped_kv`` where the vLLM backend runs the algorithm and the user sets none: about
#: where one step's selection cost meets the attention it saves there (measured on the CPU
#: build, docs/sparse.md "The cost-aware switch"). The algorithm's own default is 0: the
#: harness measures selection itself, at any size.
VLLM_MIN_SKIPPED_KV = 1_500_000


@dataclass(frozen=True)
class BlockSparseConfig:
    """Everything a block-sparse plugin is configured with, in kvfabric's configuration
    language (``kvfabric.settings``): every key checked against its type and range on
    construction, a bad value a ``ValueError`` naming it."""

    selection: SelectionConfig = setting(default_factory=SelectionConfig, doc="the budget and forced blocks")
    reuse_steps: int = setting(1, lo=1, doc="a selection is used for this many decode steps")
    min_seq_len: int = setting(4096, lo=0, doc="shorter sequences decode dense")
    min_long_requests: int = setting(1, lo=1, doc="sparse only when this many requests of the batch qualify")
    min_skipped_kv: int = setting(
        0,
        lo=0,
        doc="sparse only when the qualifying requests skip this many key elements per layer "
        "(tokens x KV heads x head dim, summed; 0: no such floor; the vLLM backend's default "
        "is VLLM_MIN_SKIPPED_KV)",
    )
    dense_layers: tuple[int, ...] = setting((), doc="layers that always run dense")
    scorer_options: Mapping[str, Any] = setting(default_factory=dict, doc="the block scorer's options")
    select_ahead: bool = setting(
        False, doc="select for step t+1 at step t (needed to prefetch; 1 step stale)"
    )
    query_window: int = setting(
        256, lo=0, doc="scorers that use the prompt's queries get those of its last tokens (0: all)"
    )

    def __post_init__(self) -> None:
        coerce_fields(self, lambda key: f"sparse configuration {key}")
        if any(x < 0 for x in self.dense_layers):
            raise ValueError(
                f"sparse configuration dense_layers must be layer indices >= 0, got {self.dense_layers!r}"
            )

    @classmethod
    def from_mapping(
        cls,
        config: Mapping[str, Any],
        scorer_keys: Iterable[str] = (),
        also_known: Iterable[str] = (),
    ) -> BlockSparseConfig:
        """Build from one flat mapping: selection keys (``budget_tokens``, ``budget_fraction``,
        ``sink_blocks``, ``recent_blocks``, ...), this class's fields, and the scorer's
        options (``scorer_keys``, e.g. ``rank``; a ``scorer_keys`` entry of the mapping is
        read too). An unknown key is a ``ValueError`` listing the known ones (with
        ``also_known``: keys the caller read before)."""
        cfg = dict(config)
        sel_keys = {f.name for f in fields(SelectionConfig)}
        own = {f.name for f in fields(cls)} - {"selection"}
        scorer_keys = set(scorer_keys) | set(cfg.pop("scorer_keys", ()))
        sel = {k: cfg.pop(k) for k in list(cfg) if k in sel_keys}
        if "budget_fraction" in sel and "budget_tokens" not in sel:
            sel["budget_tokens"] = None
        mine = {k: cfg.pop(k) for k in list(cfg) if k in own}
        scorer = dict(mine.pop("scorer_options", {}))
        scorer.update({k: cfg.pop(k) for k in list(cfg) if k in scorer_keys})
        if cfg:
            raise ValueError(
                f"unknown sparse configuration key(s) {sorted(map(str, cfg))}; known: "
                f"{sorted(sel_keys | own | scorer_keys | set(also_known))}"
            )
        return cls(selection=SelectionConfig(**sel), scorer_options=scorer, **mine)


def skipped_kv(seq_lens: Iterable[int], cfg: BlockSparseConfig, block_size: int, kv_width: int) -> int:
    """Key elements per layer that sparse attention leaves out for these sequences
    (``kv_width``: KV heads times head dim)."""
    sel = cfg.selection
    return sum(max(s - sel.num_selected(s, block_size) * block_size, 0) for s in seq_lens) * kv_width


def worth_sparse(long_seqs: Sequence[int], cfg: BlockSparseConfig, block_size: int, kv_width: int) -> bool:
    """Whether a step whose qualifying requests have these sequence lengths runs them
    sparse: conditions (3) and (4) of the module docstring."""
    if len(long_seqs) < cfg.min_long_requests:
        return False
    return cfg.min_skipped_kv == 0 or skipped_kv(long_seqs, cfg, block_size, kv_width) >= cfg.min_skipped_kv


def decide_modes(
    batch: StepBatch, num_layers: int, cfg: BlockSparseConfig, block_size: int, kv_width: int
) -> tuple[tuple[AttnMode, ...], ...]:
    """The mode of every (request, layer) for one step (see the module docstring);
    ``kv_width``: the model's KV heads times head dim."""
    long = [
        batch.is_decode(i)
        and batch.seq_lens[i] >= cfg.min_seq_len
        and cfg.selection.num_selected(batch.seq_lens[i], block_size) * block_size < batch.seq_lens[i]
        for i in range(len(batch.request_ids))
    ]
    enough = worth_sparse([s for s, q in zip(batch.seq_lens, long) if q], cfg, block_size, kv_width)
    dense_layers = set(cfg.dense_layers)
    out = []
    for is_long in long:
        sparse = is_long and enough
        out.append(
            tuple(
                AttnMode.SPARSE if sparse and layer not in dense_layers else AttnMode.DENSE
                for layer in range(num_layers)
            )
        )
    return tuple(out)


__all__ = ["VLLM_MIN_SKIPPED_KV", "BlockSparseConfig", "decide_modes", "skipped_kv", "worth_sparse"]
