"""The adaptive dense/sparse switch and the validated configuration of block-sparse plugins.

Dense attention is exact and, for short sequences, no slower: a request runs sparse in a
layer only when (1) it is decoding, (2) its sequence is at least ``min_seq_len`` tokens and
longer than the budget, (3) at least ``min_long_requests`` requests of the batch qualify
(below that the batch is dominated by dense work anyway and the scoring overhead is not
repaid), and (4) the layer is not listed in ``dense_layers``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kvfabric.ucm_layer.sparse.base import AttnMode, StepBatch
from kvfabric.ucm_layer.sparse.selection import SelectionConfig


@dataclass(frozen=True)
class BlockSparseConfig:
    """Everything a block-sparse plugin is configured with (validated on construction)."""

    selection: SelectionConfig = field(default_factory=SelectionConfig)
    reuse_steps: int = 1  # a selection is used for this many decode steps
    min_seq_len: int = 4096
    min_long_requests: int = 1
    dense_layers: tuple[int, ...] = ()
    scorer_options: Mapping[str, Any] = field(default_factory=dict)
    select_ahead: bool = False  # select for step t+1 at step t (needed to prefetch; 1 step stale)
    # scorers that use the prompt's queries get those of its last query_window tokens (0: all)
    query_window: int = 256

    def __post_init__(self) -> None:
        if (
            isinstance(self.query_window, bool)
            or not isinstance(self.query_window, int)
            or self.query_window < 0
        ):
            raise ValueError(f"query_window must be an int >= 0, got {self.query_window!r}")
        for name in ("reuse_steps", "min_long_requests"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if (
            isinstance(self.min_seq_len, bool)
            or not isinstance(self.min_seq_len, int)
            or self.min_seq_len < 0
        ):
            raise ValueError(f"min_seq_len must be an int >= 0, got {self.min_seq_len!r}")
        if any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in self.dense_layers):
            raise ValueError(f"dense_layers must be layer indices >= 0, got {self.dense_layers!r}")
        if not isinstance(self.scorer_options, Mapping):
            raise TypeError(f"scorer_options must be a mapping, got {type(self.scorer_options).__name__}")

    @classmethod
    def from_mapping(cls, config: Mapping[str, Any]) -> BlockSparseConfig:
        """Build from one flat mapping: selection keys (``budget_tokens``, ``budget_fraction``,
        ``sink_blocks``, ``recent_blocks``), this class's fields, and any other key a scorer
        option (e.g. ``rank``) only if listed in ``scorer_keys``."""
        cfg = dict(config)
        sel_keys = {f.name for f in fields(SelectionConfig)}
        own = {f.name for f in fields(cls)} - {"selection"}
        scorer_keys = set(cfg.pop("scorer_keys", ()))
        sel = {k: cfg.pop(k) for k in list(cfg) if k in sel_keys}
        if "budget_fraction" in sel and "budget_tokens" not in sel:
            sel["budget_tokens"] = None
        mine = {k: cfg.pop(k) for k in list(cfg) if k in own}
        scorer = dict(mine.pop("scorer_options", {}))
        scorer.update({k: cfg.pop(k) for k in list(cfg) if k in scorer_keys})
        if cfg:
            raise ValueError(
                f"unknown sparse configuration key(s) {sorted(cfg)}; known: "
                f"{sorted(sel_keys | own | scorer_keys)}"
            )
        if "dense_layers" in mine:
            mine["dense_layers"] = tuple(mine["dense_layers"])
        return cls(selection=SelectionConfig(**sel), scorer_options=scorer, **mine)


def decide_modes(
    batch: StepBatch, num_layers: int, cfg: BlockSparseConfig, block_size: int
) -> tuple[tuple[AttnMode, ...], ...]:
    """The mode of every (request, layer) for one step (see the module docstring)."""
    long = [
        batch.is_decode(i)
        and batch.seq_lens[i] >= cfg.min_seq_len
        and cfg.selection.num_selected(batch.seq_lens[i], block_size) * block_size < batch.seq_lens[i]
        for i in range(len(batch.request_ids))
    ]
    enough = sum(long) >= cfg.min_long_requests
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


__all__ = ["BlockSparseConfig", "decide_modes"]
