"""The block-scorer contract shared by GSA and the baselines.

A scorer holds the block summaries of one (request, layer): for each KV head, a few
numbers per block of ``block_size`` keys, on the keys' device. Call order:
``fit(keys)`` once at prefill with the prompt's keys ``(H, N, D)`` (replaces any state);
``append(keys, start)`` for every key written later (decode), at positions ``start ...``;
``scores(q)`` any time: one score per (KV head, block) for the query heads ``(H, G, D)``
of each group, higher = more attention mass expected. A partial last block is summarised
as far as it is filled and updated in place as it fills. The scorer owns its summaries
(tensors it allocates); it never keeps a reference to the caller's key tensors unless its
documentation says so (the oracle does).
"""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import Any, ClassVar

import torch

from kvfabric.registry import Registry
from kvfabric.settings import coerce_fields
from kvfabric.ucm_layer.sparse.selection import combine_group


@dataclasses.dataclass(frozen=True)
class ScorerOptions:
    """Base of a scorer's options class (``BlockScorer.options``): a frozen dataclass in
    kvfabric's configuration language (``kvfabric.settings``), each field checked against
    its type and range on construction, a bad value a ``ValueError`` naming it as
    ``"<scorer> scorer option <key>"``."""

    scorer: ClassVar[str] = "block"

    def __post_init__(self) -> None:
        coerce_fields(self, lambda key: f"{self.scorer} scorer option {key}")


class BlockScorer(abc.ABC):
    """Summaries + scoring for one (request, layer); see the module docstring."""

    name: str = "abstract"
    #: how ``scores`` combines the query heads of a group (see ``combine_group``)
    combine: str = "softmax"
    #: the frozen ``kvfabric.settings`` dataclass of the keyword options the constructor
    #: takes (checked there); None: it takes none
    options: ClassVar[type | None] = None

    def __init__(self, num_kv_heads: int, head_dim: int, block_size: int) -> None:
        for n, v in (("num_kv_heads", num_kv_heads), ("head_dim", head_dim), ("block_size", block_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{n} must be a positive int, got {v!r}")
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.num_tokens = 0
        self.fit_queries: torch.Tensor | None = None

    @property
    def num_blocks(self) -> int:
        return -(-self.num_tokens // self.block_size)

    @property
    @abc.abstractmethod
    def numbers_per_block(self) -> float:
        """Summary size per (KV head, block), in numbers of the summary dtype."""

    @property
    def summary_bytes_per_block(self) -> float:
        return self.numbers_per_block * 4.0

    def _check_keys(self, keys: torch.Tensor) -> None:
        if keys.dim() != 3 or keys.shape[0] != self.num_kv_heads or keys.shape[2] != self.head_dim:
            raise ValueError(
                f"keys must be (num_kv_heads={self.num_kv_heads}, n, head_dim={self.head_dim}), "
                f"got {tuple(keys.shape)}"
            )

    def fit(self, keys: torch.Tensor, queries: torch.Tensor | None = None) -> None:
        """Summarise the prompt's keys ``(H, N, D)``. ``queries`` ``(H, M, D)`` are the
        prompt's queries grouped by KV head; scorers that do not use them ignore them."""
        self._check_keys(keys)
        if queries is not None and (
            queries.dim() != 3 or queries.shape[0] != keys.shape[0] or queries.shape[2] != keys.shape[2]
        ):
            raise ValueError(f"queries must be (num_kv_heads, m, head_dim), got {tuple(queries.shape)}")
        self.num_tokens = 0
        self.fit_queries = queries
        try:
            self._fit(keys)
        finally:
            self.fit_queries = None
        self.num_tokens = int(keys.shape[1])

    def append(self, keys: torch.Tensor, start: int) -> None:
        self._check_keys(keys)
        if start != self.num_tokens:
            raise ValueError(f"append at position {start}, but the scorer holds {self.num_tokens} tokens")
        if keys.shape[1]:
            self._append(keys, start)
            self.num_tokens = start + int(keys.shape[1])

    #: the share of a selection's free blocks taken first by ``select_scores``' priority
    priority_share: float = 0.0

    def scores(self, q: torch.Tensor) -> torch.Tensor:
        """``(H, nb)`` combined block scores for ``q (H, G, D)``."""
        per_head = self.block_scores(q)
        return combine_group(per_head, self.combine, 1.0 / math.sqrt(self.head_dim))

    def select_scores(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(scores, priority)`` for ``q (H, G, D)``, both ``(H, nb)``: a selection takes
        the ``priority_share`` of its free blocks that rank highest by ``priority`` first,
        then the rest by ``scores``. ``priority`` is None when the scorer has none."""
        return self.scores(q), None

    @abc.abstractmethod
    def _fit(self, keys: torch.Tensor) -> None: ...

    @abc.abstractmethod
    def _append(self, keys: torch.Tensor, start: int) -> None: ...

    @abc.abstractmethod
    def block_scores(self, q: torch.Tensor) -> torch.Tensor:
        """``(H, G, nb)`` per-query-head scores (logit-like unless ``combine`` says else)."""


class GrowingRows:
    """A ``(H, capacity, width)`` tensor (one row per block, or per token) that doubles its
    capacity as rows are added."""

    def __init__(self, h: int, width: int, like: torch.Tensor, capacity: int = 64) -> None:
        self.data = torch.empty((h, max(capacity, 1), width), dtype=like.dtype, device=like.device)

    def ensure(self, nb: int) -> torch.Tensor:
        cap = self.data.shape[1]
        if nb > cap:
            new = torch.empty(
                (self.data.shape[0], max(nb, 2 * cap), self.data.shape[2]),
                dtype=self.data.dtype,
                device=self.data.device,
            )
            new[:, :cap] = self.data
            self.data = new
        return self.data


class GrowingCols:
    """A ``(H, width, capacity)`` tensor (one column per block) that doubles its capacity
    as blocks are added: scoring multiplies ``(H, G, width)`` query weights with it, a
    product that reads the columns contiguously."""

    def __init__(self, h: int, width: int, like: torch.Tensor, capacity: int = 64) -> None:
        self.data = torch.empty((h, width, max(capacity, 1)), dtype=like.dtype, device=like.device)

    def ensure(self, nb: int) -> torch.Tensor:
        cap = self.data.shape[2]
        if nb > cap:
            new = torch.empty(
                (self.data.shape[0], self.data.shape[1], max(nb, 2 * cap)),
                dtype=self.data.dtype,
                device=self.data.device,
            )
            new[:, :, :cap] = self.data
            self.data = new
        return self.data


class TokenRowsScorer(BlockScorer):
    """A scorer that keeps one row per token (the oracle: the key itself; HATA: its sign
    code) in its own growing buffer. Subclasses give ``row_width`` and ``token_rows``;
    ``prepare(keys)`` runs at ``fit`` before the prompt's rows are made."""

    def __init__(self, num_kv_heads: int, head_dim: int, block_size: int) -> None:
        super().__init__(num_kv_heads, head_dim, block_size)
        self._rows: GrowingRows | None = None

    @property
    @abc.abstractmethod
    def row_width(self) -> int: ...

    @abc.abstractmethod
    def token_rows(self, keys: torch.Tensor) -> torch.Tensor:
        """``(H, n, row_width)`` rows of keys ``(H, n, D)``."""

    def prepare(self, keys: torch.Tensor) -> None:
        """Hook: at ``fit``, before the rows of the prompt's keys are made."""

    def rows(self) -> torch.Tensor:
        """``(H, num_tokens, row_width)`` (a view; do not keep it across appends)."""
        if self._rows is None:
            raise ValueError(f"{self.name}: no rows yet, call fit() first")
        return self._rows.data[:, : self.num_tokens]

    def _fit(self, keys: torch.Tensor) -> None:
        self.prepare(keys)
        n = keys.shape[1]
        self._rows = GrowingRows(keys.shape[0], self.row_width, keys, capacity=max(1024, 2 * n))
        self._rows.ensure(n)[:, :n] = self.token_rows(keys)

    def _append(self, keys: torch.Tensor, start: int) -> None:
        if self._rows is None:
            raise ValueError(f"{self.name}: append() before fit()")
        end = start + keys.shape[1]
        self._rows.ensure(end)[:, start:end] = self.token_rows(keys)


class RowMaxScorer(BlockScorer):
    """A scorer whose block summary is the element-wise max of per-key rows, with an upper
    bound ``query_weights(q) . summary`` on ``q.k`` over each block (GSA, Quest) and a
    ranking score ``ranking_weights(q) . summary`` (the bound unless a subclass says else).
    Subclasses give ``key_rows`` and ``query_weights``; rows are max-reductions, so a partial
    block updates in place."""

    _FIT_CHUNK = 16384  # tokens summarised per pass at prefill (bounds temporary memory)

    def __init__(self, num_kv_heads: int, head_dim: int, block_size: int) -> None:
        super().__init__(num_kv_heads, head_dim, block_size)
        self._cols: GrowingCols | None = None

    @property
    def numbers_per_block(self) -> float:
        return float(self.row_width)

    @property
    @abc.abstractmethod
    def row_width(self) -> int: ...

    @abc.abstractmethod
    def key_rows(self, keys: torch.Tensor) -> torch.Tensor:
        """``(H, n, row_width)`` rows of keys ``(H, n, D)``."""

    @abc.abstractmethod
    def query_weights(self, q: torch.Tensor) -> torch.Tensor:
        """``(H, G, row_width)`` weights of queries ``(H, G, D)`` that make the bound."""

    def ranking_weights(self, q: torch.Tensor) -> torch.Tensor:
        """``(H, G, row_width)`` weights whose product with the summaries ranks blocks."""
        return self.query_weights(q)

    # The same rows and weights for many requests at once (``sparse.paged``): ``params`` is
    # what one fitted request's rows depend on (``batch_params()``, stacked over requests
    # as a leading dimension), keys/queries carry the same leading dimension. A scorer
    # whose rows depend on nothing fitted keeps these defaults.
    def batch_params(self) -> torch.Tensor | None:
        """The fitted request's parameters its rows and weights depend on (None: none)."""
        return None

    def rows_with(self, keys: torch.Tensor, params: torch.Tensor | None) -> torch.Tensor:
        """``key_rows`` of ``keys (..., H, n, D)`` for requests with ``params``."""
        return self.key_rows(keys)

    def bound_weights_with(self, q: torch.Tensor, params: torch.Tensor | None) -> torch.Tensor:
        """``query_weights`` of ``q (..., H, G, D)`` for requests with ``params``."""
        return self.query_weights(q)

    def ranking_weights_with(self, q: torch.Tensor, params: torch.Tensor | None) -> torch.Tensor:
        """``ranking_weights`` of ``q (..., H, G, D)`` for requests with ``params``."""
        return self.ranking_weights(q)

    def select_weights_with(self, q: torch.Tensor, params: torch.Tensor | None) -> torch.Tensor:
        """``(..., H, G, row_width)`` ranking weights of ``q (..., H, G, D)``, followed, with a
        ``priority_share``, by one row of bound weights of the group's mean query (``G + 1``
        rows): what one product with the summaries turns into ranking and priority."""
        w = self.ranking_weights_with(q, params)
        if not self.priority_share:
            return w
        return torch.cat([w, self.bound_weights_with(q.mean(dim=-2, keepdim=True), params)], dim=-2)

    def _columns(self) -> torch.Tensor:
        """``(H, row_width, nb)``: the summaries, one column per block (a view)."""
        if self._cols is None:
            raise ValueError(f"{self.name}: no summaries yet, call fit() first")
        return self._cols.data[:, :, : self.num_blocks]

    @property
    def summaries(self) -> torch.Tensor:
        """``(H, nb, row_width)`` (a view; do not keep it across appends)."""
        return self._columns().transpose(1, 2)

    def _fit(self, keys: torch.Tensor) -> None:
        h, n, _ = keys.shape
        bs = self.block_size
        nb = -(-n // bs)
        self._cols = GrowingCols(h, self.row_width, keys, capacity=max(64, 2 * nb))
        out = self._cols.ensure(nb)
        step = max(bs, self._FIT_CHUNK - self._FIT_CHUNK % bs)
        for s in range(0, n, step):
            blocks = edge_block_view(self.key_rows(keys[:, s : s + step]), bs).amax(dim=2)
            out[:, :, s // bs : s // bs + blocks.shape[1]] = blocks.transpose(1, 2)

    def _append(self, keys: torch.Tensor, start: int) -> None:
        if self._cols is None:
            raise ValueError(f"{self.name}: append() before fit()")
        n = keys.shape[1]
        rows = self.key_rows(keys)
        bs = self.block_size
        b0, b1 = start // bs, (start + n - 1) // bs
        out = self._cols.ensure(b1 + 1)
        idx = ((torch.arange(n, device=keys.device) + start) // bs - b0).view(1, n, 1).expand_as(rows)
        fresh = rows.new_full((rows.shape[0], b1 - b0 + 1, rows.shape[2]), float("-inf"))
        fresh.scatter_reduce_(1, idx, rows, reduce="amax", include_self=True)
        if start % bs:  # the first block already holds keys: merge
            fresh[:, 0] = torch.maximum(fresh[:, 0], out[:, :, b0])
        out[:, :, b0 : b1 + 1] = fresh.transpose(1, 2)

    def bound(self, q: torch.Tensor) -> torch.Tensor:
        """``(H, G, nb)``: an upper bound on ``q.k`` over the keys of each block."""
        return torch.matmul(self.query_weights(q), self._columns())

    def block_scores(self, q: torch.Tensor) -> torch.Tensor:
        return torch.matmul(self.ranking_weights(q), self._columns())

    def scores(self, q: torch.Tensor) -> torch.Tensor:
        if self.combine != "softmax":
            return super().scores(q)
        # the logit scale folded into the (small) weights: one product, one softmax
        w = self.ranking_weights(q) * (1.0 / math.sqrt(self.head_dim))
        return torch.softmax(torch.matmul(w, self._columns()), dim=-1).sum(dim=1)

    def select_scores(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """With a ``priority_share``, the priority is the bound for the group's mean query
        (one more row in the same product; a per-head order needs no normalisation)."""
        if not self.priority_share or self.combine != "softmax":
            return super().select_scores(q)
        g = q.shape[1]
        w = torch.cat([self.ranking_weights(q), self.query_weights(q.mean(dim=1, keepdim=True))], dim=1)
        s = torch.matmul(w * (1.0 / math.sqrt(self.head_dim)), self._columns())
        return torch.softmax(s[:, :g], dim=-1).sum(dim=1), s[:, g]


def edge_block_view(rows: torch.Tensor, block_size: int) -> torch.Tensor:
    """``(H, n, X)`` -> ``(H, nb, block_size, X)``, the last block padded with copies of the
    last row (neutral for a max or a min)."""
    n = rows.shape[1]
    pad = -n % block_size
    if pad:
        rows = torch.cat([rows, rows[:, -1:].expand(-1, pad, -1)], dim=1)
    return rows.reshape(rows.shape[0], -1, block_size, rows.shape[2])


def block_view(keys: torch.Tensor, block_size: int, fill: float) -> torch.Tensor:
    """``(H, N, X)`` -> ``(H, nb, block_size, X)``, the last block padded with ``fill``."""
    h, n, x = keys.shape
    nb = -(-n // block_size)
    pad = nb * block_size - n
    if pad:
        keys = torch.cat([keys, keys.new_full((h, pad, x), fill)], dim=1)
    return keys.reshape(h, nb, block_size, x)


#: scorer name -> "module:Class", imported on first use
SCORERS: Registry[type[BlockScorer]] = Registry(
    "block scorer",
    {
        "gsa": "kvfabric.ucm_layer.sparse.gsa.summary:SvdMaxNormScorer",
        "quest": "kvfabric.ucm_layer.sparse.baselines.quest:QuestScorer",
        "meankey": "kvfabric.ucm_layer.sparse.baselines.meankey:MeanKeyScorer",
        "hata": "kvfabric.ucm_layer.sparse.baselines.hata:HataScorer",
        "oracle": "kvfabric.ucm_layer.sparse.baselines.oracle:OracleScorer",
    },
    kind=BlockScorer,
)


def scorer_option_names(name: str) -> tuple[str, ...]:
    """The option keys of the scorer registered as ``name`` (its ``options`` fields)."""
    klass = SCORERS.load(name)
    return tuple(f.name for f in dataclasses.fields(klass.options)) if klass.options is not None else ()


def make_scorer(name: str, num_kv_heads: int, head_dim: int, block_size: int, **options: Any) -> BlockScorer:
    """A fresh scorer registered as ``name``; ``options`` are its ``options`` fields (an
    unknown key is a ``ValueError`` listing the known ones, a bad value one naming it)."""
    known = scorer_option_names(name)
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"unknown {name} scorer option(s) {unknown}; known: {sorted(known)}")
    return SCORERS.load(name)(num_kv_heads, head_dim, block_size, **options)


__all__ = [
    "SCORERS",
    "BlockScorer",
    "GrowingCols",
    "GrowingRows",
    "RowMaxScorer",
    "ScorerOptions",
    "TokenRowsScorer",
    "block_view",
    "edge_block_view",
    "make_scorer",
    "scorer_option_names",
]
