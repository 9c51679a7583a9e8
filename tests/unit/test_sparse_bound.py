"""GSA's block summary bounds q.k for every key of every block: never violated.

The bound is computed the way the plugin computes it (float32 summaries, one matrix
product) and compared with the exact q.k in float64.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch_threads import one_torch_thread  # noqa: F401

from kvfabric.ucm_layer.sparse.gsa.summary import SvdMaxNormScorer, fit_basis
from kvfabric.ucm_layer.sparse.scorer import make_scorer


def _block_max_true(q: torch.Tensor, keys: torch.Tensor, bs: int) -> torch.Tensor:
    """(H, G, nb) exact max over each block's keys of q.k (float64)."""
    s = torch.matmul(q.double(), keys.double().transpose(1, 2))
    h, g, n = s.shape
    pad = -n % bs
    s = torch.nn.functional.pad(s, (0, pad), value=float("-inf"))
    return s.reshape(h, g, -1, bs).amax(-1)


def _violations(scorer: SvdMaxNormScorer, q: torch.Tensor, keys: torch.Tensor) -> int:
    bound = scorer.bound(q).double()
    true = _block_max_true(q, keys, scorer.block_size)
    return int((bound < true).sum())


def _fitted(
    keys: torch.Tensor, rank: int, bs: int, prefix: int | None = None, groups: int = 1
) -> SvdMaxNormScorer:
    h, n, d = keys.shape
    s = SvdMaxNormScorer(h, d, bs, rank=rank, residual_groups=min(groups, max(1, d - rank)))
    cut = n if prefix is None else prefix
    s.fit(keys[:, :cut])
    t = cut
    step = 1
    while t < n:  # decode-style appends, 1, 2, 3... tokens at a time, crossing block edges
        s.append(keys[:, t : t + step], t)
        t += step
        step = step % 5 + 1
    return s


def _cases(gen: torch.Generator) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    h, n, d, g = 3, 300, 64, 4
    r = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    cases = {
        "gaussian": (r(h, n, d), r(h, g, d)),
        "mean_and_outliers": (r(h, n, d) + 5.0, r(h, g, d)),
        "huge": (r(h, n, d) * 1e4, r(h, g, d) * 1e3),
        "tiny": (r(h, n, d) * 1e-4, r(h, g, d) * 1e-3),
        "anisotropic": (r(h, n, d) * torch.logspace(-3, 2, d), r(h, g, d) * torch.logspace(2, -3, d)),
        "q_equals_keys": None,
    }
    k = cases["gaussian"][0]
    cases["q_equals_keys"] = (k, k[:, :g].clone())
    low = torch.matmul(r(h, n, 4), r(h, 4, d))  # rank 4 < rank of the basis: residual ~ 0
    cases["low_rank_keys"] = (low, r(h, g, d))
    return cases


@pytest.mark.parametrize("rank", [1, 8, 32, 64])
@pytest.mark.parametrize("block_size", [1, 16, 7])
@pytest.mark.parametrize("groups", [1, 5])
def test_bound_never_violated_on_random_and_adversarial_data(rank, block_size, groups):
    gen = torch.Generator().manual_seed(rank * 100 + block_size)
    for name, (keys, q) in _cases(gen).items():
        for prefix in (None, 37):  # fitted at once, or fitted on a prefix then appended
            s = _fitted(keys, rank, block_size, prefix, groups)
            assert _violations(s, q, keys) == 0, f"{name} rank={rank} bs={block_size} prefix={prefix}"


def test_bound_is_tight_case_with_aligned_residuals():
    """One key per block, and the query's residual parallel to the key's: Cauchy-Schwarz
    holds with equality, so only the rounding margin keeps the bound above q.k."""
    gen = torch.Generator().manual_seed(7)
    h, d, rank, n = 2, 64, 8, 64
    base = torch.randn(h, 512, d, generator=gen)
    s = SvdMaxNormScorer(h, d, 1, rank=rank)
    basis = fit_basis(base, rank)
    e = torch.randn(h, d, generator=gen)
    e = e - torch.matmul(torch.matmul(e.unsqueeze(1), basis), basis.transpose(1, 2)).squeeze(1)
    a = torch.randn(h, n, rank, generator=gen)
    c = torch.rand(h, n, 1, generator=gen) * 10
    keys = torch.matmul(a, basis.transpose(1, 2)) + c * e.unsqueeze(1)
    s.basis = basis
    s.fit = None  # type: ignore[assignment]  # keep this basis: build the rows directly
    from kvfabric.ucm_layer.sparse.scorer import RowMaxScorer

    RowMaxScorer._fit(s, keys)
    s.num_tokens = n
    for scale in (0.0, 1.0, 3.0):
        q = torch.matmul(a[:, :4], basis.transpose(1, 2)) + scale * e.unsqueeze(1)
        assert _violations(s, q, keys) == 0, scale
    # q orthogonal to the basis (p = 0): the residual term alone carries the bound
    assert _violations(s, e.unsqueeze(1).expand(h, 3, d).contiguous(), keys) == 0


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 90),
    d=st.sampled_from([8, 32, 64]),
    rank_frac=st.floats(0.05, 1.0),
    bs=st.integers(1, 20),
    scale=st.sampled_from([1e-3, 1.0, 1e3]),
    shift=st.floats(-50, 50),
)
def test_bound_property(seed, n, d, rank_frac, bs, scale, shift):
    gen = torch.Generator().manual_seed(seed)
    keys = (torch.randn(2, n, d, generator=gen) + shift) * scale
    q = torch.randn(2, 3, d, generator=gen) * scale
    rank = max(1, int(rank_frac * d))
    s = _fitted(keys, rank, bs, prefix=max(1, n // 2))
    assert _violations(s, q, keys) == 0


def test_incremental_summaries_equal_one_shot_rows():
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(2, 203, 32, generator=gen)
    a = _fitted(keys, 8, 16, prefix=50)
    from kvfabric.ucm_layer.sparse.scorer import edge_block_view

    expect = edge_block_view(a.key_rows(keys), 16).amax(dim=2)
    assert torch.allclose(a.summaries, expect)
    assert a.num_blocks == 13 and a.numbers_per_block == 17


@pytest.mark.parametrize("name", ["quest", "meankey", "hata", "oracle"])
def test_baseline_scorers_append_equals_fit(name):
    gen = torch.Generator().manual_seed(5)
    keys = torch.randn(2, 130, 32, generator=gen)
    q = torch.randn(2, 3, 32, generator=gen)
    a = make_scorer(name, 2, 32, 16)
    a.fit(keys[:, :41])
    for t in range(41, 130, 3):
        a.append(keys[:, t : t + 3], t)
    b = make_scorer(name, 2, 32, 16)
    b.fit(keys)
    assert torch.allclose(a.block_scores(q), b.block_scores(q), atol=1e-4)
    assert a.scores(q).shape == (2, 9)


def test_quest_bound_holds_and_scorer_arguments_are_checked():
    gen = torch.Generator().manual_seed(9)
    keys = torch.randn(2, 100, 16, generator=gen) * 3 + 1
    q = torch.randn(2, 2, 16, generator=gen)
    s = make_scorer("quest", 2, 16, 8)
    s.fit(keys)
    assert (s.block_scores(q).double() >= _block_max_true(q, keys, 8) - 1e-4).all()
    with pytest.raises(ValueError, match="unknown block scorer"):
        make_scorer("nope", 2, 16, 8)
    with pytest.raises(ValueError, match="rank"):
        make_scorer("gsa", 2, 16, 8, rank=17)
    with pytest.raises(ValueError, match=r"unknown quest scorer option\(s\) \[.rank.\]; known: \[\]"):
        make_scorer("quest", 2, 16, 8, rank=3)
    with pytest.raises(ValueError, match="keys must be"):
        s.fit(torch.zeros(3, 10, 16))
    with pytest.raises(ValueError, match="append at position"):
        s.append(torch.zeros(2, 1, 16), 5)
    with pytest.raises(ValueError, match="fit"):
        SvdMaxNormScorer(2, 16, 8).block_scores(q)
