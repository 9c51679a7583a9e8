"""kvfabric's vLLM sparse backend without an engine: the block-table rewrite and vLLM's
real CPU kernel over it, the request tracking of the runtime with a real GSA plugin, the
configuration's validation and the registration in vLLM's backend registry."""

from __future__ import annotations

import json
import math

import pytest
import torch
from sparse_runtimes import close_runtimes  # noqa: F401  (autouse fixture)

from kvfabric.ucm_layer.sparse.base import LayerKV, ModelSpec
from kvfabric.ucm_layer.sparse.vllm.config import SparseBackendConfig, from_mapping
from kvfabric.ucm_layer.sparse.vllm.rewrite import fold_heads, pack_rows, replace_rows, union_rows
from kvfabric.ucm_layer.sparse.vllm.runtime import SparseRuntime, layer_index

H, G, D, BS = 2, 3, 32, 32


def _reference(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
    """``q (G, D)`` over ``keys/vals (N, D)``."""
    p = torch.softmax(q @ keys.T / math.sqrt(q.shape[-1]), dim=-1)
    return p @ vals


def test_pack_rows_puts_the_partial_block_last_and_drops_unused() -> None:
    tables = torch.tensor([[7, 3, 9, 4]])
    lens = torch.tensor([[5, 32, 0, 32]])
    bt, seq = pack_rows(tables, lens)
    assert bt.dtype == torch.int32 and bt[0, :3].tolist() == [3, 4, 7]
    assert seq.tolist() == [69]


def test_union_rows_merges_heads_and_replace_rows_keeps_other_rows() -> None:
    tables = torch.tensor([[[0, 5, 8], [0, 6, 8]]])  # one request, two heads
    lens = torch.tensor([[[32, 32, 10], [32, 32, 10]]])
    bt, seq = union_rows(tables, lens)
    assert sorted(bt[0, :3].tolist()) == [0, 5, 6] and int(bt[0, 3]) == 8 and seq.tolist() == [106]
    full = torch.arange(20, dtype=torch.int32).view(2, 10)
    new_bt, new_sl = replace_rows(
        full, torch.tensor([300, 310], dtype=torch.int32), {1: (tables[0], lens[0])}
    )
    assert torch.equal(new_bt[0], full[0]) and int(new_sl[0]) == 300
    assert int(new_sl[1]) == 106 and int(new_bt[1, 3]) == 8
    assert int(full[1, 0]) == 10  # the caller's table is not modified


def _filled_cache(num_blocks: int, tokens: int, blocks: torch.Tensor):
    """vLLM CPU cache with ``tokens`` random keys/values written through vLLM's own writer."""
    from vllm import _custom_ops as ops

    from kvfabric.ucm_layer.sparse.vllm.cpu import split_cache

    kv = torch.zeros(num_blocks, H, BS, 2 * D)
    kc, vc = split_cache(kv)
    k, v = torch.randn(tokens, H, D), torch.randn(tokens, H, D)
    pos = torch.arange(tokens)
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, (blocks[pos // BS] * BS + pos % BS).long(), "vec")
    return kc, vc, k, v


def test_sparse_decode_equals_dense_attention_over_the_selected_blocks() -> None:
    pytest.importorskip("vllm._custom_ops")
    from kvfabric.ucm_layer.sparse.vllm.cpu import pad_selections, sparse_decode

    torch.manual_seed(0)
    nb, tokens = 24, 330  # 11 logical blocks, the last one partial (10 tokens)
    blocks = torch.randperm(nb)[:11]
    kc, vc, k, v = _filled_cache(nb, tokens, blocks)
    q = torch.randn(2, H * G, D)  # two requests reading the same cache
    logical = [
        (torch.tensor([[0, 4, 10], [0, 7, 10]]), torch.tensor([[32, 32, 10], [32, 32, 10]])),
        (torch.tensor([[0, 2, 3, 10], [1, 5, 9, 10]]), torch.tensor([[32, 32, 32, 10], [32, 32, 0, 10]])),
    ]
    tables, lens = pad_selections([(blocks[t], ln) for t, ln in logical])
    out = sparse_decode(q, kc, vc, tables, lens, 1 / math.sqrt(D), "vec")
    for s, (t, ln) in enumerate(logical):
        for h in range(H):
            toks = torch.cat(
                [torch.arange(b * BS, b * BS + n) for b, n in zip(t[h].tolist(), ln[h].tolist()) if n]
            )
            ref = _reference(q[s].view(H, G, D)[h], k[toks, h], v[toks, h])
            torch.testing.assert_close(out[s].view(H, G, D)[h], ref, atol=1e-5, rtol=1e-5)


def test_the_cache_views_read_back_the_keys_and_values_vllms_writer_stored() -> None:
    # vLLM's CPU writer stores a block's keys transposed for its vec kernels (values as
    # rows): the plugin's summaries, the oracle and HATA read keys through these views
    pytest.importorskip("vllm._custom_ops")
    import types

    from vllm import _custom_ops as ops

    from kvfabric.ucm_layer.sparse.vllm.cpu import KeyLayout, KVFabricCPUSparseImpl, key_layout, split_cache

    torch.manual_seed(1)
    nb, tokens = 24, 330
    blocks = torch.randperm(nb)[:11]
    raw = torch.zeros(nb, H, BS, 2 * D)
    kc, vc = split_cache(raw)
    k, v = torch.randn(tokens, H, D), torch.randn(tokens, H, D)
    pos = torch.arange(tokens)
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, (blocks[pos // BS] * BS + pos % BS).long(), "vec")
    assert key_layout("vec", D, BS, torch.float32) is KeyLayout.COLUMNS
    impl = object.__new__(KVFabricCPUSparseImpl)
    impl.head_size = D
    view = impl._cache_views(raw, types.SimpleNamespace(isa="vec"))
    for got, want in ((view.k, k), (view.v, v)):
        assert torch.equal(got[:, blocks].reshape(H, 11 * BS, D)[:, :tokens], want.transpose(0, 1))


def test_folded_rows_with_every_block_equal_the_stock_dense_call() -> None:
    pytest.importorskip("vllm._custom_ops")
    from kvfabric.ucm_layer.sparse.vllm.cpu import paged_attention, sparse_decode

    torch.manual_seed(1)
    nb, tokens = 16, 200
    blocks = torch.randperm(nb)[:7]
    kc, vc, _, _ = _filled_cache(nb, tokens, blocks)
    q = torch.randn(1, H * G, D)
    dense = torch.empty_like(q)
    paged_attention(
        q,
        kc,
        vc,
        dense,
        torch.tensor([0, 1], dtype=torch.int32),
        torch.tensor([tokens], dtype=torch.int32),
        blocks.view(1, -1).to(torch.int32),
        1 / math.sqrt(D),
        "vec",
    )
    lens = torch.full((7,), BS)
    lens[-1] = tokens - 6 * BS
    table = blocks.expand(H, 7)
    out = sparse_decode(q, kc, vc, table[None], lens.expand(H, 7)[None], 1 / math.sqrt(D), "vec")
    torch.testing.assert_close(out, dense, atol=1e-6, rtol=1e-5)
    bt, seq = fold_heads(table[None], lens.expand(H, 7)[None])
    assert bt.shape == (H, 7) and seq.tolist() == [tokens] * H


def _runtime(tmp_path, idle_steps: int = 32, batched: bool = True, **options) -> SparseRuntime:
    cfg = from_mapping(
        {
            "algorithm": "gsa",
            "stats_path": str(tmp_path / "stats.json"),
            "min_seq_len": 0,
            "min_skipped_kv": 0,
            **options,
        }
    )
    spec = ModelSpec(num_layers=2, num_q_heads=H * G, num_kv_heads=H, head_dim=D, block_size=BS)
    return SparseRuntime(cfg, spec, idle_steps=idle_steps, batched=batched)


def _kv(num_blocks: int = 64) -> LayerKV:
    return LayerKV(torch.zeros(H, num_blocks, BS, D), torch.zeros(H, num_blocks, BS, D))


def _step(
    rt: SparseRuntime, table: torch.Tensor, seqs: list[int], news: list[int], kv: LayerKV | None = None
):
    qsl = torch.tensor([0, *torch.tensor(news).cumsum(0).tolist()], dtype=torch.int32)
    md = object()
    kv = _kv() if kv is None else kv
    plan = rt.plan(md, table, torch.tensor(seqs, dtype=torch.int32), qsl, kv.num_blocks)
    n = int(qsl[-1])
    q, k, v = torch.randn(n, H * G, D), torch.randn(n, H, D), torch.randn(n, H, D)
    chosen = []
    for layer in range(2):
        if plan is None:
            break
        chosen.append(rt.layer_begin(plan, layer, (q, k, v), kv))
        rt.layer_end(plan, layer, torch.zeros(n, H * G, D), kv)
    return plan, chosen


@pytest.mark.parametrize("batched", [True, False])
def test_runtime_tracks_requests_by_their_first_block_and_goes_sparse_past_the_budget(
    tmp_path, batched
) -> None:
    rt = _runtime(tmp_path, batched=batched, budget_tokens=4 * BS, sink_blocks=1, recent_blocks=1)
    assert (rt.paged is not None) == batched
    table = torch.arange(40, dtype=torch.int32).view(2, 20)
    prompt = 10 * BS + 5
    plan, chosen = _step(rt, table[:1], [prompt], [prompt])  # prefill: dense
    assert plan is not None and chosen == [None, None]
    plan, chosen = _step(rt, table[:1], [prompt + 1], [1])  # decode past the budget: sparse
    assert plan.rows == [0]
    for sel in chosen:
        blocks, lens = sel.physical[0], sel.lens[0]
        assert blocks.shape == (H, 4) and int(lens[0].sum()) == 3 * BS + 6
        assert set(blocks[:, 0].tolist()) == {0} and set(blocks[:, -1].tolist()) == {10}  # sink, recent
    # a row whose first new position does not match what the plugin saw stays dense
    plan, chosen = _step(rt, table, [prompt + 2, 3 * BS + 1], [1, 1])
    assert plan.rows == [0] and chosen[0].rows == (0,)
    # a new prefill from position 0 on the same first block replaces the finished request
    plan, chosen = _step(rt, table[:1], [2 * BS], [2 * BS])
    assert rt.stats.requests == 2 and len(rt._by_block) == 1
    rt.close()  # the stats file's thread writes the last step's counters now
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["sparse_layer_steps"] == 4 and stats["blocks_selected"] == 16 and stats["blocks_total"] == 44
    assert stats["layers"][0] == {"sparse": 2, "dense": 1} and stats["plugin"]["selections"] > 0


def _two_request_run(tmp_path, batched: bool, floor: int | None) -> list:
    """Two requests prefill, decode together, then one alone, then together again; the
    chosen selections of each decode step (None: dense)."""
    torch.manual_seed(11)
    opts = {} if floor is None else {"min_skipped_kv": floor}
    cfg = from_mapping(
        {"algorithm": "gsa", "min_seq_len": 0, "budget_tokens": 4 * BS, "sink_blocks": 1, "recent_blocks": 1}
        | opts
    )
    spec = ModelSpec(num_layers=2, num_q_heads=H * G, num_kv_heads=H, head_dim=D, block_size=BS)
    rt = SparseRuntime(cfg, spec, batched=batched)
    table = torch.arange(40, dtype=torch.int32).view(2, 20)
    kv = _kv()
    p = 10 * BS + 5
    out = []
    _step(rt, table, [p, p], [p, p], kv)
    out.append(_step(rt, table, [p + 1, p + 1], [1, 1], kv)[1])
    out.append(_step(rt, table[:1], [p + 2], [1], kv)[1])
    out.append(_step(rt, table, [p + 3, p + 2], [1, 1], kv)[1])
    rt.close()
    return [rt.plugin.cfg.min_skipped_kv, *out]


@pytest.mark.parametrize("batched", [True, False])
def test_a_step_whose_long_requests_skip_too_little_runs_dense_and_the_next_selects_as_before(
    tmp_path, batched
) -> None:
    from kvfabric.ucm_layer.sparse.gsa.policy import VLLM_MIN_SKIPPED_KV, BlockSparseConfig, skipped_kv

    default, *_ = _two_request_run(tmp_path, batched, None)
    assert default == VLLM_MIN_SKIPPED_KV  # the engine's default, where the user sets none
    sel = BlockSparseConfig.from_mapping({"budget_tokens": 4 * BS, "sink_blocks": 1, "recent_blocks": 1})
    one = skipped_kv([10 * BS + 7], sel, BS, H * D)  # one request at its third decode step
    floor, together, alone, again = _two_request_run(tmp_path, batched, one + 1)
    assert floor == one + 1
    assert together is not None and all(c is not None for c in together)  # two skip enough
    # one alone does not: every layer runs dense (batched: the stock forward, no plan)
    assert alone == ([] if batched else [None, None])
    assert again is not None and all(c is not None for c in again)
    # after the dense step, the same selections as with no floor (the summaries' catch-up
    # from the cache is what the decode-needle test checks)
    _, *no_floor = _two_request_run(tmp_path, batched, 0)
    assert all(c is not None for c in no_floor[1])  # without the floor, alone is sparse
    for a, b in zip(again, no_floor[2]):
        assert torch.equal(a.physical, b.physical) and torch.equal(a.lens, b.lens)


NEEDLE = 9  # the logical block holding the keys the decode query looks for


def _chunked_selection(tmp_path, batched: bool, chunks: list[int]) -> torch.Tensor:
    """The logical blocks (per layer and KV head, sorted) a decode step selects after one
    prompt came in ``chunks`` (token counts, vLLM's chunked prefill), its keys in the cache.
    The prompt's first ``BS + 3`` keys span dimensions 0-7 only, the later ones the
    others, and block ``NEEDLE`` holds keys along the decode query: a basis fitted on the
    first chunk alone cannot see that block."""
    torch.manual_seed(5)
    rt = _runtime(tmp_path, batched=batched, budget_tokens=4 * BS, sink_blocks=1, recent_blocks=1)
    table = torch.randperm(40, dtype=torch.int32)[:20].view(1, 20)
    prompt = sum(chunks)
    k, v = torch.randn(prompt + 1, H, D) * 0.1, torch.randn(prompt + 1, H, D)
    head = BS + 3
    k[:head, :, :8] += torch.randn(head, H, 8) * 3
    k[head:, :, 8:16] += torch.randn(prompt + 1 - head, H, 8) * 3
    u = torch.zeros(D)
    u[16:] = 1.0
    k[NEEDLE * BS : (NEEDLE + 1) * BS] += 3 * u
    q = torch.randn(prompt + 1, H * G, D) * 0.1
    q[-1] += 3 * u
    kv = _kv()
    pos = 0
    chosen = []
    for n in [*chunks, 1]:
        at = torch.arange(pos, pos + n)
        kv.k[:, table[0, at // BS].long(), at % BS] = k[pos : pos + n].transpose(0, 1)
        qsl = torch.tensor([0, n], dtype=torch.int32)
        plan = rt.plan(object(), table, torch.tensor([pos + n], dtype=torch.int32), qsl, kv.num_blocks)
        assert plan is not None
        chosen = []
        step = (q[pos : pos + n], k[pos : pos + n], v[pos : pos + n])
        for layer in range(2):
            chosen.append(rt.layer_begin(plan, layer, step, kv))
            rt.layer_end(plan, layer, torch.zeros(n, H * G, D), kv)
        pos += n
    assert all(c is not None for c in chosen)  # the decode step is sparse
    logical = {int(b): i for i, b in enumerate(table[0].tolist())}
    return torch.tensor(
        [[sorted(logical[int(b)] for b in c.physical[0, h]) for h in range(H)] for c in chosen]
    )


@pytest.mark.parametrize("batched", [True, False])
def test_a_prompt_prefilled_in_chunks_selects_what_one_prefill_would(tmp_path, batched) -> None:
    # vLLM's chunked prefill gives a prompt what is left of a step's token budget, then the
    # rest: the summaries are fitted on the whole prompt at its first decode step, so the
    # selection does not depend on where the chunks were cut
    prompt = 14 * BS + 5
    whole = _chunked_selection(tmp_path, batched, [prompt])
    assert bool((whole == NEEDLE).any(dim=-1).all())  # every layer and head finds the needle
    for chunks in ([BS + 3, prompt - BS - 3], [BS + 3, 7 * BS, prompt - 8 * BS - 3]):
        assert torch.equal(_chunked_selection(tmp_path, batched, chunks), whole), chunks


def _decode_selections(
    tmp_path, batched: bool, switch: int, by_floor: bool = False
) -> list[list[list[int]] | None]:
    """Per decode step, the logical blocks (layer 0, per KV head, sorted) one request
    selects, or None while it is below the switch. The request decodes ``2 * BS`` tokens
    past a ``10 * BS + 5`` prompt and crosses ``min_seq_len`` (``switch``) on the way, or
    with ``by_floor`` the cost-aware floor (``min_skipped_kv``) at the same length;
    the keys of block 11, written by decode steps only, lie along the later queries."""
    from kvfabric.ucm_layer.sparse.gsa.policy import BlockSparseConfig, skipped_kv

    torch.manual_seed(7)
    sel = {"budget_tokens": 4 * BS, "sink_blocks": 1, "recent_blocks": 1}
    switch_at = {"min_seq_len": switch}
    if by_floor:
        floor = skipped_kv([switch], BlockSparseConfig.from_mapping(sel), BS, H * D)
        switch_at = {"min_seq_len": 0, "min_skipped_kv": floor}
    rt = _runtime(tmp_path, batched=batched, **sel, **switch_at)
    table = torch.randperm(40, dtype=torch.int32)[:20].view(1, 20)
    prompt, steps = 10 * BS + 5, 3 * BS
    total = prompt + steps
    k, v = torch.randn(total, H, D), torch.randn(total, H, D)
    u = torch.zeros(D)
    u[:8] = 1.0
    k[11 * BS : 12 * BS] += 3 * u
    q = torch.randn(total, H * G, D)
    q[12 * BS :] += 3 * u
    kv = _kv()
    out: list[list[list[int]] | None] = []
    logical = {int(b): i for i, b in enumerate(table[0].tolist())}
    pos = 0
    for n in [prompt] + [1] * steps:
        at = torch.arange(pos, pos + n)
        kv.k[:, table[0, at // BS].long(), at % BS] = k[pos : pos + n].transpose(0, 1)
        qsl = torch.tensor([0, n], dtype=torch.int32)
        plan = rt.plan(object(), table, torch.tensor([pos + n], dtype=torch.int32), qsl, kv.num_blocks)
        # a step with nothing to summarise or select runs the stock forward (no plan)
        assert plan is not None or (batched and n == 1)
        step = (q[pos : pos + n], k[pos : pos + n], v[pos : pos + n])
        chosen = [None, None] if plan is None else []
        for layer in range(2 if plan is not None else 0):
            chosen.append(rt.layer_begin(plan, layer, step, kv))
            rt.layer_end(plan, layer, torch.zeros(n, H * G, D), kv)
        if n == 1:
            c = chosen[0]
            out.append(None if c is None else [sorted(logical[int(b)] for b in hd) for hd in c.physical[0]])
        pos += n
    return out


@pytest.mark.parametrize("switch", [11 * BS, 12 * BS + 3])
def test_decode_keys_reach_the_summaries_as_per_request_updates_make_them(tmp_path, switch) -> None:
    # the batched path summarises a block from the cache when it fills (block 11 fills
    # below a switch of 12 * BS + 3) and the partial block before a selection (block 11
    # fills while the request selects at 11 * BS); the hooks update per key: the same
    # selections
    batched = _decode_selections(tmp_path, True, switch)
    assert batched == _decode_selections(tmp_path, False, switch)
    # below the cost-aware floor a request lags the same way (no key added, sealed on
    # fill, its partial block refreshed before its first selection): the same selections
    assert _decode_selections(tmp_path, True, switch, by_floor=True) == batched
    assert _decode_selections(tmp_path, False, switch, by_floor=True) == batched
    first = switch - (10 * BS + 5) - 1  # the first step at the switch's length
    assert all(sel is None for sel in batched[:first]) and None not in batched[first:]
    # once block 11 is full and not the recent block, every selection finds its keys
    late = batched[max(first, 12 * BS + 1 - (10 * BS + 5)) :]
    assert late and all(11 in head for sel in late for head in sel)


def test_runtime_keeps_short_contexts_dense(tmp_path) -> None:
    rt = _runtime(tmp_path, budget_tokens=8 * BS)
    table = torch.arange(20, dtype=torch.int32).view(1, 20)
    _step(rt, table, [6 * BS], [6 * BS])
    plan, chosen = _step(rt, table, [6 * BS + 1], [1])  # block 5 is full: summarised, dense
    assert plan is not None and chosen == [None, None]
    plan, chosen = _step(rt, table, [6 * BS + 2], [1])
    assert plan is None and chosen == []  # nothing to do: the stock forward in every layer
    assert rt.snapshot()["dense_layer_steps"] == 4 and rt.snapshot()["sparse_layer_steps"] == 0


def test_runtime_finishes_requests_no_row_matched_for_idle_steps(tmp_path) -> None:
    rt = _runtime(tmp_path, idle_steps=2, budget_tokens=4 * BS)
    table = torch.arange(40, dtype=torch.int32).view(2, 20)
    _step(rt, table[:1], [3 * BS], [3 * BS])
    _step(rt, table[1:], [2 * BS], [2 * BS])
    for n in range(1, 3):
        _step(rt, table[1:], [2 * BS + n], [1])
    assert {st.first_block for st in rt._by_block.values()} == {20}
    plan, _ = _step(rt, table[:1], [3 * BS + 1], [1])  # the finished request's row is not trusted
    assert plan is None


def test_config_errors_name_the_key(tmp_path) -> None:
    with pytest.raises(ValueError, match="algorithm"):
        from_mapping({"algorithm": "nope"})
    with pytest.raises(ValueError, match="no 'algorithm'"):
        from_mapping({"budget_tokens": 1024})
    with pytest.raises(ValueError, match="offload"):
        from_mapping({"algorithm": "gsa", "offload": True})
    with pytest.raises(ValueError, match="contradicts"):
        from_mapping({"algorithm": "quest"}, connector_algorithm="gsa")
    with pytest.raises(ValueError, match="budget_tokens"):
        _runtime(tmp_path, budget_tokens=-3)
    assert from_mapping(None, connector_algorithm="gsa") == SparseBackendConfig("gsa", {}, None)
    assert not from_mapping(None).enabled
    assert layer_index("model.layers.11.self_attn.attn") == 11


def test_backends_register_once_in_vllms_registry() -> None:
    registry = pytest.importorskip("vllm.v1.attention.backends.registry")
    from kvfabric.ucm_layer.connector import plugin

    plugin.register_backends()
    assert plugin.register_backends() == []
    enum = registry.AttentionBackendEnum
    assert enum.CPU_ATTN.get_path() == plugin.BACKENDS["CPU_ATTN"]
    assert enum.CUSTOM.get_path() == plugin.BACKENDS["CUSTOM"]
    assert enum.CPU_ATTN.get_class().get_name() == "CPU_ATTN"
