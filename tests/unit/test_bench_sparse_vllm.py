"""The pure parts of ``kvfabric bench sparse-vllm``: the prompt set, the comparison with
dense (found keys, identical answers, coarse KL) and the compute-saved figures."""

from __future__ import annotations

import math

import pytest

from kvfabric.bench.sparse.passkeys import FILLERS, NEEDLES, FirstDecode, accuracy, coarse_kl, prompt_specs
from kvfabric.bench.sparse_vllm import KVGeometry, kv_read


def test_prompt_specs_are_deterministic_and_vary_depth_filler_and_needle():
    a, b = prompt_specs(4300, 12), prompt_specs(4300, 12)
    assert a == b and len(a) == 12
    assert len({s.seed for s in a}) == 12
    assert {s.filler for s in a} == set(range(len(FILLERS)))
    assert {s.needle for s in a} == set(range(len(NEEDLES)))
    assert len({s.depth for s in a}) >= 4
    assert prompt_specs(4300, 3, offset=100)[0].seed == 100
    with pytest.raises(ValueError, match="count"):
        prompt_specs(4300, 0)


def _lp(probs: dict[int, float]) -> dict[int, float]:
    return {t: math.log(p) for t, p in probs.items()}


def test_coarse_kl_is_zero_for_equal_maps_and_exact_on_full_support():
    p = _lp({1: 0.7, 2: 0.2, 3: 0.1})
    assert coarse_kl(p, p) == (pytest.approx(0.0, abs=1e-12), pytest.approx(0.0, abs=1e-12))
    q = _lp({1: 0.5, 2: 0.3, 3: 0.2})
    exact = 0.7 * math.log(0.7 / 0.5) + 0.2 * math.log(0.2 / 0.3) + 0.1 * math.log(0.1 / 0.2)
    assert coarse_kl(p, q)[0] == pytest.approx(exact)


def test_coarse_kl_buckets_tokens_outside_both_top_k():
    p = _lp({1: 0.6, 2: 0.3})  # 0.1 elsewhere
    q = _lp({1: 0.5, 3: 0.4})  # token 2 not in q's top-k: bucketed with the rest
    kl, rest = coarse_kl(p, q)
    assert rest == pytest.approx(0.4)
    assert kl == pytest.approx(0.6 * math.log(0.6 / 0.5) + 0.4 * math.log(0.4 / 0.5))


def test_accuracy_counts_lost_keys_matches_and_kl():
    same = _lp({7: 0.9, 8: 0.1})
    dense = [FirstDecode((1, 2), same), FirstDecode((3, 4), same), FirstDecode((5, 6), same)]
    method = [
        FirstDecode((1, 2), same),
        FirstDecode((3, 9), _lp({7: 0.8, 8: 0.2})),
        FirstDecode((5, 6), same),
    ]
    acc = accuracy(
        ["11111", "22222", "33333"],
        dense,
        [" 11111.", " 22222.", " 44444."],
        method,
        [" 11111.", " 2222.", " 33333."],
    )
    assert (acc.prompts, acc.dense_found, acc.found, acc.passkeys_lost) == (3, 2, 2, 1)
    assert acc.answers_match_dense == pytest.approx(2 / 3)
    kl = 0.9 * math.log(0.9 / 0.8) + 0.1 * math.log(0.1 / 0.2)
    assert acc.kl_max == pytest.approx(kl) and acc.kl_mean == pytest.approx(kl / 3)
    with pytest.raises(ValueError, match="one dense"):
        accuracy([], [], [], [], [])


def test_kv_read_keeps_compute_saved_apart_and_counts_dense_layer_steps_in_full():
    geo = KVGeometry(layers=2, kv_heads=3, block_bytes=100)
    delta = {"blocks_selected": 8, "blocks_total": 40, "sparse_layer_steps": 4, "dense_layer_steps": 0}
    r = kv_read(delta, geo, batch=2)
    assert r["kv_read_frac"] == 0.2 and r["sparse_layer_share"] == 1.0
    assert r["dense_kv_bytes_per_step"] == 2 * 2 * 3 * 100 * 10
    assert r["kv_bytes_per_step"] == 2 * 2 * 3 * 100 * 2
    half = kv_read({**delta, "dense_layer_steps": 4}, geo, batch=2)
    assert half["kv_bytes_per_step"] == 2 * 2 * 3 * 100 * 6
    assert kv_read({}, geo, 1)["kv_bytes_per_step"] is None


def test_run_config_from_the_environment(monkeypatch) -> None:
    import pytest

    from kvfabric.bench.sparse_vllm import RunConfig

    monkeypatch.setenv("KVFABRIC_BENCH_SPARSE_VLLM", '{"cases": ["tiny"], "options": {"rank": 8}}')
    rc = RunConfig.from_env()
    assert rc.cases == ("tiny",) and rc.options == (("rank", 8),) and rc.tiny_prompts == 8
    monkeypatch.setenv("KVFABRIC_BENCH_SPARSE_VLLM", '{"case": ["tiny"]}')
    with pytest.raises(ValueError, match="unknown keys"):
        RunConfig.from_env()
    monkeypatch.setenv("KVFABRIC_BENCH_SPARSE_VLLM", '{"cases": ["big"]}')
    with pytest.raises(ValueError, match="cases"):
        RunConfig.from_env()


def test_flanked_runs_set_each_method_run_against_the_dense_runs_beside_it() -> None:
    from kvfabric.bench.sparse_vllm import flanked, run_order

    assert run_order(["gsa", "quest"], 1) == [None, "gsa", "quest"]
    order = run_order(["gsa"], 3)
    assert order == [None, "gsa", None, "gsa", None, "gsa", None]
    # the machine slows down by half after the first dense run and recovers before the
    # last: each run is set against the geometric mean of the dense runs on either side
    steps = [30.0, 15.0, 45.0, 15.0, 45.0, 10.0, 30.0]
    pairs = flanked(order, steps)["gsa"]
    assert pairs == [(15.0, (30 * 45) ** 0.5), (15.0, 45.0), (10.0, (45 * 30) ** 0.5)]
    # one round, two methods: the later method is set against the first dense run
    assert flanked([None, "gsa", "quest"], [30.0, 10.0, 15.0]) == {
        "gsa": [(10.0, 30.0)],
        "quest": [(15.0, 30.0)],
    }
    # a run with no timed step is left out, and so is a dense run with none
    assert flanked(order, [30.0, None, None, 15.0, 45.0, 10.0, 30.0])["gsa"] == [
        (15.0, (30.0 * 45.0) ** 0.5),
        (10.0, (45.0 * 30.0) ** 0.5),
    ]


def test_run_config_takes_rounds_and_refuses_zero(monkeypatch) -> None:
    import pytest

    from kvfabric.bench.sparse_vllm import RunConfig

    monkeypatch.setenv("KVFABRIC_BENCH_SPARSE_VLLM", '{"cases": ["tiny"], "rounds": 3}')
    assert RunConfig.from_env().rounds == 3
    monkeypatch.setenv("KVFABRIC_BENCH_SPARSE_VLLM", '{"rounds": 0}')
    with pytest.raises(ValueError, match="rounds=0"):
        RunConfig.from_env()
