"""GSA's block summary: a rank-r SVD basis joined with a max-norm of the residual.

For each KV head, ``U (D, r)`` holds the top-r right singular vectors of the prompt's keys
and (``basis="keys+queries"``, the default) of the queries of its last tokens, weighted
``query_weight`` (fitted at prefill from ``K^T K`` and ``Q^T Q``, in float64; ``r``
defaults to ``head_dim / 4``; with no queries given, the keys alone). A block of keys
``k`` keeps

    M_i  = max_k (U^T k)_i + tau_k          (r numbers)
    -m_i = max_k -(U^T k)_i + tau_k         (r numbers; stored negated, so every row is a max)
    R    = max_k |k - U U^T k| + tau_k      (1 number)

with ``tau_k = margin * |k|`` (a relative 1e-5 by default) absorbing float32 rounding.
For a query ``q`` with ``p = U^T q`` and ``q_res = q - U p``:

    bound = sum_i max(p_i M_i, p_i m_i) + |q_res| R  >=  q . k   for every key of the block,

because ``q.k = p.(U^T k) + q_res.k_res`` (the residual is orthogonal to U) and each term is
bounded separately (Cauchy-Schwarz for the residual); the margins add at least
``|q| tau_k`` to the bound. With ``p+ = max(p, 0)`` and ``p- = max(-p, 0)`` the bound is
one matrix product ``[M, -m, R] . [p+, p-, |q_res|]``, so scoring reads ``2r + 1`` numbers
per block (Quest reads ``2D``). Rows are max-reductions, so a block is updated in place as
its keys arrive during decode (``RowMaxScorer``).

Ranking. The bound is the summary's guarantee (``bound()``), but it is loose as a ranking:
the box ``[m, M]`` is reached only when one key holds every coordinate's extreme, and the
residual term charges every block the full ``|q_res| R``. With ``select="estimate"`` blocks
are ranked by the same summary read with other weights (one matrix product, no extra
numbers): the box centre ``c = (M + m) / 2``, a fraction ``spread`` of the box half-width
``w = (M - m) / 2`` and a fraction ``residual`` of the residual term:

    estimate = p.c + spread * |p|.w + residual * |q_res| R
             = ((p + spread |p|) / 2).M + ((spread |p| - p) / 2).(-m) + residual |q_res|.R

``spread = residual = 1`` is the bound itself. ``select="mixed"`` (the default) takes a
``bound_share`` of each selection's free blocks by the bound first (single-token spikes,
which the estimate's fractions can rank too low), the rest by the estimate; ``"bound"``
ranks by the bound alone. The bound stays what ``bound()`` returns in every mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvfabric.settings import setting
from kvfabric.ucm_layer.sparse.scorer import RowMaxScorer, ScorerOptions

_GRAM_CHUNK = 16384


def _gram(x: torch.Tensor, max_tokens: int) -> torch.Tensor:
    if x.shape[1] > max_tokens:
        x = x[:, :: -(-x.shape[1] // max_tokens)]
    h, n, d = x.shape
    gram = torch.zeros((h, d, d), dtype=torch.float64, device=x.device)
    for s in range(0, n, _GRAM_CHUNK):
        c = x[:, s : s + _GRAM_CHUNK].to(torch.float64)
        gram += torch.matmul(c.transpose(1, 2), c)
    return gram


def fit_basis(
    keys: torch.Tensor,
    rank: int,
    max_tokens: int = 65536,
    queries: torch.Tensor | None = None,
    query_weight: float = 0.5,
) -> torch.Tensor:
    """``(H, D, rank)`` orthonormal bases: the top right singular vectors of each head's
    keys ``(H, N, D)`` (eigenvectors of ``K^T K`` in float64, largest first; ``rank = D``
    gives the whole orthonormal basis). Beyond ``max_tokens`` keys, an evenly strided
    sample of them is used. With ``queries (H, M, D)``, the basis is fitted to keys and
    queries together, each set normalised to unit total energy and the queries weighted
    ``query_weight`` against ``1 - query_weight`` for the keys (so that the directions the
    queries look along are in the basis too)."""
    gram = _gram(keys, max_tokens)
    if queries is not None and queries.shape[1]:
        gq = _gram(queries, max_tokens)
        gram = gram / gram.diagonal(dim1=1, dim2=2).sum(-1).clamp(min=1e-30).view(-1, 1, 1)
        gq = gq / gq.diagonal(dim1=1, dim2=2).sum(-1).clamp(min=1e-30).view(-1, 1, 1)
        gram = gram * (1.0 - query_weight) + gq * query_weight
    _, vecs = torch.linalg.eigh(gram)  # ascending eigenvalues
    q, _ = torch.linalg.qr(vecs[:, :, -rank:].flip(-1))  # re-orthonormalise before the cast
    return q.to(keys.dtype).contiguous()


def default_rank(head_dim: int) -> int:
    """GSA's default basis rank: a quarter of the head dimension (16 of SmolLM2's 64, 32 of
    128), so a block's summary is ``head_dim / 2 + 1`` numbers."""
    return max(1, head_dim // 4)


@dataclass(frozen=True)
class SummaryOptions(ScorerOptions):
    """The options of GSA's scorer (the ``gsa`` plugin's scorer keys), in kvfabric's
    configuration language: each checked against its type and range, a bad value a
    ``ValueError`` naming it; limits that depend on the head dimension are checked by the
    scorer."""

    rank: int | None = setting(None, lo=1, doc="basis rank, at most head_dim (None: head_dim / 4)")
    margin: float = setting(1e-5, lo=0, hi=0.01, doc="relative slack per key that absorbs rounding")
    basis_tokens: int = setting(65536, lo=1, doc="keys (an even sample beyond) the basis is fitted to")
    residual_groups: int = setting(1, lo=1, doc="max-norms of the residual space (at most head_dim - rank)")
    basis: str = setting(
        "keys+queries", choices=("keys", "keys+queries"), doc="fit the basis to the keys, or keys and queries"
    )
    select: str = setting("mixed", choices=("bound", "estimate", "mixed"), doc="how blocks are ranked")
    spread: float = setting(0.5, lo=0, hi=1, doc="estimate: share of the box half-width")
    residual: float = setting(0.25, lo=0, hi=1, doc="estimate: share of the residual term")
    query_weight: float = setting(0.35, lo=0, hi=1, doc="keys+queries: the queries' weight in the basis")
    bound_share: float = setting(0.5, gt=0, hi=1, doc="mixed: share of the free blocks taken by the bound")

    scorer: ClassVar[str] = "gsa"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.bound_share >= 1:
            raise ValueError(
                f"gsa scorer option bound_share={self.bound_share!r}: expected a number in (0, 1)"
            )


class SvdMaxNormScorer(RowMaxScorer):
    """GSA's bound (see the module docstring); ``options`` are :class:`SummaryOptions`'
    (rank ``head_dim / 4`` and a basis fitted to the prompt's keys and queries by default)."""

    name = "gsa"
    combine = "softmax"
    options = SummaryOptions

    def __init__(self, num_kv_heads: int, head_dim: int, block_size: int, **options: Any) -> None:
        super().__init__(num_kv_heads, head_dim, block_size)
        o = SummaryOptions(**options)
        rank = default_rank(head_dim) if o.rank is None else o.rank
        if rank > head_dim:
            raise ValueError(
                f"gsa scorer option rank={rank}: expected an integer in [1, head_dim={head_dim}]"
            )
        if o.basis_tokens < rank:
            raise ValueError(
                f"gsa scorer option basis_tokens={o.basis_tokens}: expected an integer >= rank ({rank})"
            )
        if o.residual_groups > max(1, head_dim - rank):
            raise ValueError(
                f"gsa scorer option residual_groups={o.residual_groups}: expected an integer in "
                f"[1, head_dim - rank = {head_dim - rank}]"
            )
        self.priority_share = o.bound_share if o.select == "mixed" else 0.0
        self.select = o.select
        self.query_weight = o.query_weight
        self.spread = o.spread
        self.residual = o.residual
        self.basis_source = o.basis
        self.groups = o.residual_groups
        self.complement: torch.Tensor | None = None  # (H, D, D - r) when groups > 1
        self._assign: torch.Tensor | None = None  # (D - r, groups) 0/1
        self.basis_tokens = o.basis_tokens
        self.rank = rank
        self.margin = o.margin
        self.basis: torch.Tensor | None = None  # (H, D, r)

    @property
    def row_width(self) -> int:
        return 2 * self.rank + self.groups

    def _basis(self) -> torch.Tensor:
        if self.basis is None:
            raise ValueError("the scorer has no basis yet: call fit() with the prompt's keys first")
        return self.basis

    def _fit(self, keys: torch.Tensor) -> None:
        # keys+queries with no queries given (or none captured): the keys' basis
        queries = self.fit_queries if self.basis_source == "keys+queries" else None
        if self.groups == 1:
            self.basis = fit_basis(keys, self.rank, self.basis_tokens, queries, self.query_weight)
        else:
            full = fit_basis(keys, self.head_dim, self.basis_tokens, queries, self.query_weight)
            self.basis = full[:, :, : self.rank].contiguous()
            self.complement = full[:, :, self.rank :].contiguous()
            rest = self.head_dim - self.rank
            group = torch.arange(rest, device=keys.device) * self.groups // rest
            self._assign = torch.nn.functional.one_hot(group, self.groups).to(keys.dtype)
        super()._fit(keys)

    def _residual_norms(
        self, x: torch.Tensor, p: torch.Tensor, basis: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``(..., groups)`` norms of the residual of ``x`` in each residual subspace
        (``basis``: the fitted one unless given, ``groups == 1`` only)."""
        if self.groups == 1:
            u = self._basis() if basis is None else basis
            return (x - torch.matmul(p, u.transpose(-1, -2))).norm(dim=-1, keepdim=True)
        if self.complement is None or self._assign is None:
            raise ValueError("the scorer has no residual basis yet: call fit() first")
        c = torch.matmul(x, self.complement)
        return torch.matmul(c * c, self._assign).sqrt()

    def key_rows(self, keys: torch.Tensor) -> torch.Tensor:
        return self.rows_with(keys, None)

    def query_weights(self, q: torch.Tensor) -> torch.Tensor:
        """``(H, G, 2r + groups)``: ``[p+, p-, |q_res| per group]`` for ``q (H, G, D)`` (the bound)."""
        return self.bound_weights_with(q, None)

    def ranking_weights(self, q: torch.Tensor) -> torch.Tensor:
        """The bound's weights, or with ``select="estimate"`` those of the estimate (see the
        module docstring)."""
        return self.ranking_weights_with(q, None)

    # ``params`` is a basis ``(..., H, D, r)`` (None: the fitted one); batched use needs
    # ``residual_groups == 1`` (``batch_params`` refuses otherwise).
    def batch_params(self) -> torch.Tensor:
        if self.groups != 1:
            raise ValueError("gsa: batched scoring needs residual_groups = 1")
        return self._basis()

    def rows_with(self, keys: torch.Tensor, params: torch.Tensor | None) -> torch.Tensor:
        u = self._basis() if params is None else params
        p = torch.matmul(keys, u)  # (..., H, n, r)
        tau = keys.norm(dim=-1, keepdim=True) * self.margin
        return torch.cat([p + tau, tau - p, self._residual_norms(keys, p, params) + tau], dim=-1)

    def _project(self, q: torch.Tensor, params: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(p, |q_res|)``: the basis coordinates of ``q (..., D)`` and its residual norm."""
        p = torch.matmul(q, self._basis() if params is None else params)
        return p, self._residual_norms(q, p, params)

    @staticmethod
    def _bound_cols(p: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
        """The bound's weights ``[p+, p-, |q_res|]`` from a projection."""
        return torch.cat([p.clamp(min=0), (-p).clamp(min=0), res], dim=-1)

    def _estimate_cols(self, p: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
        """The estimate's weights from a projection (see the module docstring)."""
        a = p.abs() * self.spread
        return torch.cat([(a + p) * 0.5, (a - p) * 0.5, res * self.residual], dim=-1)

    def bound_weights_with(self, q: torch.Tensor, params: torch.Tensor | None) -> torch.Tensor:
        return self._bound_cols(*self._project(q, params))

    def ranking_weights_with(self, q: torch.Tensor, params: torch.Tensor | None) -> torch.Tensor:
        if self.select == "bound":
            return self.bound_weights_with(q, params)
        # "estimate", and "mixed" (the estimate ranks, the bound picks bound_share first)
        return self._estimate_cols(*self._project(q, params))

    def select_weights_with(self, q: torch.Tensor, params: torch.Tensor | None) -> torch.Tensor:
        if self.select != "mixed" or self.groups != 1:
            return super().select_weights_with(q, params)
        # one projection of the queries and their mean (the bound's query) for both parts
        g = q.shape[-2]
        p, res = self._project(torch.cat([q, q.mean(dim=-2, keepdim=True)], dim=-2), params)
        rank = self._estimate_cols(p[..., :g, :], res[..., :g, :])
        return torch.cat([rank, self._bound_cols(p[..., g:, :], res[..., g:, :])], dim=-2)


__all__ = ["SummaryOptions", "SvdMaxNormScorer", "default_rank", "fit_basis"]
