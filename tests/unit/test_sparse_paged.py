"""Batched selection over a paged cache (``sparse.paged``) against the per-request hooks'
selection, for every algorithm; and the vLLM runtime's request identity in batched mode:
a reordered batch gets each request's own selection, a block table planted with another
request's blocks runs dense."""

from __future__ import annotations

import pytest
import torch
from sparse_runtimes import close_runtimes  # noqa: F401  (autouse fixture)

from kvfabric.ucm_layer.sparse.base import LayerKV, ModelSpec, create
from kvfabric.ucm_layer.sparse.blocksparse import LayerState, recent_queries
from kvfabric.ucm_layer.sparse.paged import PagedSelector, SparseRows, paged_support
from kvfabric.ucm_layer.sparse.scorer import make_scorer
from kvfabric.ucm_layer.sparse.vllm.config import from_mapping
from kvfabric.ucm_layer.sparse.vllm.runtime import SparseRuntime

H, G, D, BS, NB = 2, 3, 16, 8, 96
SPEC = ModelSpec(num_layers=1, num_q_heads=H * G, num_kv_heads=H, head_dim=D, block_size=BS)


def _write(kv: LayerKV, row: torch.Tensor, keys: torch.Tensor, start: int) -> None:
    """Keys ``(n, H, D)`` at positions ``start...`` of the request with physical ``row``."""
    pos = torch.arange(start, start + keys.shape[0])
    kv.k[:, row[pos // BS].long(), pos % BS] = keys.transpose(0, 1)


def _reference(plugin, prompt_k, prompt_q, decode_k, q, seq):
    """The free blocks (logical, per head) of one request whose scorer was fitted on its
    whole prompt, however it was chunked, and its combined scores."""
    sc = make_scorer(plugin.scorer_name, H, D, BS, **plugin.cfg.scorer_options)
    sc.fit(prompt_k.permute(1, 0, 2), recent_queries(prompt_q, H, plugin.cfg.query_window))
    for j in range(decode_k.shape[0]):
        sc.append(decode_k[j : j + 1].permute(1, 0, 2), prompt_k.shape[0] + j)
    nb = -(-seq // BS)
    k = plugin.cfg.selection.num_selected(seq, BS)
    return plugin._select_free(LayerState(sc), q.view(H, G, D), nb, k), sc.scores(q.view(H, G, D))


@pytest.mark.parametrize(
    "name,options",
    [
        ("gsa", {}),
        ("gsa", {"select": "estimate", "rank": 3}),
        ("gsa", {"allocation": "layer"}),
        ("quest", {}),
        ("meankey", {}),
        ("oracle", {}),
        ("hata", {"bits": 32}),
    ],
)
def test_batched_selection_equals_the_per_request_hooks(name: str, options: dict) -> None:
    torch.manual_seed(3)
    plugin = create(name, SPEC, {"budget_tokens": 6 * BS, "sink_blocks": 1, "recent_blocks": 2, **options})
    assert paged_support(plugin) is None
    sel = PagedSelector(plugin)
    kv = LayerKV(torch.zeros(H, NB, BS, D), torch.zeros(H, NB, BS, D))
    perm = torch.randperm(NB)
    prompts, decodes = [13 * BS + 3, 17 * BS + 7, 11 * BS], 10  # ragged, crossing block edges
    splits = [13 * BS + 3, 5 * BS + 3, 6 * BS]  # two prompts come in two chunks (chunked prefill)
    rows, slots, seqs, data = [], [], [], []
    for r, n in enumerate(prompts):
        row = perm[r * 32 : (r + 1) * 32]
        k, q = torch.randn(n, H, D) * 2, torch.randn(n, H * G, D)
        _write(kv, row, k, 0)
        slot = sel.begin(f"r{r}")
        sel.prompt_chunk(0, slot, q[: splits[r]], 0)
        if splits[r] < n:
            sel.prompt_chunk(0, slot, q[splits[r] :], splits[r])
        sel.fit_prompt(0, kv, slot, n, row)  # at the first decode step, from the cache
        rows.append(row)
        slots.append(slot)
        data.append((k, q))
    dec = torch.randn(decodes, len(prompts), H, D)
    for t in range(decodes):
        pos = torch.tensor([n + t for n in prompts])
        phys = torch.stack([rows[r][int(p) // BS] for r, p in enumerate(pos)])
        for r in range(len(prompts)):
            _write(kv, rows[r], dec[t, r : r + 1], int(pos[r]))
        sel.append(0, kv, torch.tensor(slots), dec[t], phys, pos % BS == 0)
    seqs = [n + decodes for n in prompts]
    q = torch.randn(len(prompts), H * G, D)
    sr = SparseRows(torch.stack(rows), seqs, slots, plugin)
    physical, lens = sel.select(0, kv, sr, q)
    if hasattr(sel.layers[0], "full_product_ratio"):  # the other scoring path gives the same blocks
        sel.layers[0].full_product_ratio = 0.0
        other, _ = sel.select(0, kv, sr, q)
        assert torch.equal(other.sort(dim=-1).values, physical.sort(dim=-1).values)
    per_head = options.get("allocation") != "layer"
    assert (
        physical.shape[:2] == (3, H) and sr.tail_last == per_head and (physical.shape[2] == 6 or not per_head)
    )
    for r, seq in enumerate(seqs):
        nb = -(-seq // BS)
        ref, scores = _reference(plugin, data[r][0], data[r][1], dec[:, r], q[r], seq)
        logical = {int(p): b for b, p in enumerate(rows[r][:nb].tolist())}
        for h in range(H):
            forced = {0, nb - 2, nb - 1}
            want = forced | {int(b) for b in ref[h] if b >= 0}
            got = {logical[int(b)] for b, n in zip(physical[r, h], lens[r, h]) if n > 0}
            if name == "hata":  # integer scores: ties may break either way, the scores may not
                assert got >= forced and len(got) == len(want)
                assert sorted(scores[h, sorted(got - forced)].tolist()) == sorted(
                    scores[h, sorted(want - forced)].tolist()
                )
            else:
                assert got == want, (name, r, h)
        tail = seq - (nb - 1) * BS
        used = lens[r] > 0
        assert int(lens[r].sum()) == int(used.sum()) * BS - (BS - tail) * H
        if sr.tail_last:
            assert torch.equal(physical[r, :, -1], rows[r][nb - 1].expand(H)) and bool(
                (lens[r, :, -1] == tail).all()
            )


def _runtime(tmp_path) -> SparseRuntime:
    cfg = from_mapping(
        {
            "algorithm": "gsa",
            "budget_tokens": 4 * BS,
            "min_seq_len": 0,
            "min_skipped_kv": 0,
            "stats_path": str(tmp_path / "stats.json"),
        }
    )
    rt = SparseRuntime(cfg, SPEC)
    assert rt.paged is not None
    return rt


def _run(rt, table, seqs, news, q, k, kv):
    qsl = torch.tensor([0, *torch.tensor(news).cumsum(0).tolist()], dtype=torch.int32)
    plan = rt.plan(object(), table, torch.tensor(seqs, dtype=torch.int32), qsl, kv.num_blocks)
    if plan is None:
        return None
    sel = rt.layer_begin(plan, 0, (q, k, torch.zeros_like(k)), kv)
    rt.layer_end(plan, 0, torch.zeros_like(q), kv)
    return sel


def _two_prompts(rt, kv, table, n):
    torch.manual_seed(0)
    ka, kb = torch.randn(n, H, D), torch.randn(n, H, D) * 3
    qa, qb = torch.randn(n, H * G, D), torch.randn(n, H * G, D)
    for r, k in enumerate((ka, kb)):
        _write(kv, table[r], k, 0)
    assert _run(rt, table, [n, n], [n, n], torch.cat([qa, qb]), torch.cat([ka, kb]), kv) is None


def test_a_reordered_batch_gets_each_requests_own_selection(tmp_path) -> None:
    n = 12 * BS + 2
    table = torch.arange(2 * 20, dtype=torch.int32).view(2, 20)
    q, k = torch.randn(2, H * G, D), torch.randn(2, H, D)
    got = []
    for order in ((0, 1), (1, 0)):
        rt, kv = _runtime(tmp_path), LayerKV(torch.zeros(H, NB, BS, D), torch.zeros(H, NB, BS, D))
        _two_prompts(rt, kv, table, n)
        idx = list(order)
        sel = _run(rt, table[idx], [n + 1, n + 1], [1, 1], q[idx], k[idx], kv)
        assert sel is not None and sel.rows == (0, 1)
        got.append({order[j]: sel.physical[j] for j in range(2)})
    for r in range(2):
        assert torch.equal(got[0][r], got[1][r])
        assert set(got[0][r].flatten().tolist()) <= set(table[r].tolist())


def test_a_block_table_with_another_requests_blocks_runs_dense(tmp_path) -> None:
    n = 12 * BS + 2
    table = torch.arange(2 * 20, dtype=torch.int32).view(2, 20)
    rt, kv = _runtime(tmp_path), LayerKV(torch.zeros(H, NB, BS, D), torch.zeros(H, NB, BS, D))
    _two_prompts(rt, kv, table, n)
    planted = table.clone()
    planted[0, 1:] = table[1, 1:]  # request A's first block, request B's summaries behind it
    q, k = torch.randn(2, H * G, D), torch.randn(2, H, D)
    sel = _run(rt, planted, [n + 1, n + 1], [1, 1], q, k, kv)
    assert sel is not None and sel.rows == (1,)  # only B selects; A's row runs dense
    snap = rt.snapshot()
    assert snap["identity_mismatch"] == 1 and snap["tracked_requests"] == 1
    # the dropped state is not trusted again: the row stays dense from then on
    sel = _run(rt, table, [n + 2, n + 2], [1, 1], q, k, kv)
    assert sel is not None and sel.rows == (1,)


def test_rows_of_different_lengths_are_checked_only_over_the_blocks_each_has_seen(tmp_path) -> None:
    # the shorter request's table row goes on past its blocks with the longer one's (as a
    # reused row of vLLM's block table may): those entries are not its blocks yet, and must
    # not make its row look like another request's
    short, long = 10 * BS + 2, 14 * BS + 5
    table = torch.arange(2 * 20, dtype=torch.int32).view(2, 20)
    table[0, -(-short // BS) :] = table[1, -(-short // BS) :]
    rt, kv = _runtime(tmp_path), LayerKV(torch.zeros(H, NB, BS, D), torch.zeros(H, NB, BS, D))
    torch.manual_seed(1)
    ks = [torch.randn(n, H, D) for n in (short, long)]
    qs = [torch.randn(n, H * G, D) for n in (short, long)]
    for r in range(2):
        _write(kv, table[r], ks[r], 0)
    assert _run(rt, table, [short, long], [short, long], torch.cat(qs), torch.cat(ks), kv) is None
    q, k = torch.randn(2, H * G, D), torch.randn(2, H, D)
    for t in (1, 2):
        sel = _run(rt, table, [short + t, long + t], [1, 1], q, k, kv)
        assert sel is not None and sel.rows == (0, 1), t
    assert rt.snapshot()["identity_mismatch"] == 0


@pytest.mark.parametrize("name", ["gsa", "quest", "meankey"])
def test_blocks_summarised_when_they_fill_select_what_per_key_updates_select(name: str) -> None:
    """``seal`` from the cache (a block when it fills, the partial last block before a
    selection) against ``append`` of every key: the same summaries for every block a
    selection ranks or normalises over, the same selections at every decode step."""
    torch.manual_seed(5)
    plugin = create(name, SPEC, {"budget_tokens": 6 * BS, "sink_blocks": 1, "recent_blocks": 1})
    per_key, sealing = PagedSelector(plugin), PagedSelector(plugin)
    assert sealing.seals
    kv = LayerKV(torch.zeros(H, NB, BS, D), torch.zeros(H, NB, BS, D))
    perm = torch.randperm(NB)
    prompts = [13 * BS + 3, 9 * BS]  # one ends inside a block, one on a block edge
    rows, slots = [], []
    for r, n in enumerate(prompts):
        row = perm[r * 40 : (r + 1) * 40]
        _write(kv, row, torch.randn(n, H, D) * 2, 0)
        q = torch.randn(n, H * G, D)
        for sel in (per_key, sealing):
            slot = sel.begin(f"r{r}")
            sel.prompt_chunk(0, slot, q, 0)
            sel.fit_prompt(0, kv, slot, n, row)
        rows.append(row)
        slots.append(slot)
    slot_t = torch.tensor(slots)
    for t in range(3 * BS):
        pos = torch.tensor([n + t for n in prompts])
        keys = torch.randn(len(prompts), H, D) * 2
        for r in range(len(prompts)):
            _write(kv, rows[r], keys[r : r + 1], int(pos[r]))
        phys = torch.stack([rows[r][int(p) // BS] for r, p in enumerate(pos)])
        per_key.append(0, kv, slot_t, keys, phys, pos % BS == 0)
        full = [r for r, p in enumerate(pos.tolist()) if p % BS == 0 and p >= BS]
        if full:
            prev = torch.stack([rows[r][int(pos[r]) // BS - 1] for r in full])
            sealing.seal(0, kv, slot_t[full], prev, torch.full((len(full),), BS))
        if t % 3 == 0:  # the rows select in this step: their partial blocks first
            sealing.seal(0, kv, slot_t, phys, pos % BS + 1)
        else:
            continue
        seqs = (pos + 1).tolist()
        sr = SparseRows(torch.stack(rows), seqs, slots, plugin)
        q = torch.randn(len(prompts), H * G, D)
        a, la = per_key.select(0, kv, sr, q)
        b, lb = sealing.select(0, kv, sr, q)
        assert torch.equal(a.sort(dim=-1).values, b.sort(dim=-1).values) and torch.equal(la, lb), t
        for r, s in enumerate(seqs):  # every block's summary is the per-key one
            done = rows[r][: -(-s // BS)].long()
            torch.testing.assert_close(
                sealing.layers[0].store[:, :, done], per_key.layers[0].store[:, :, done]
            )


@pytest.mark.parametrize("select", ["mixed", "estimate", "bound"])
def test_the_selection_weights_are_the_ranking_then_the_bound_of_the_mean_query(select: str) -> None:
    # GSA's batched weights project the queries and their mean once; they must be the
    # per-request ranking weights followed (mixed only) by the bound's weights of the mean
    torch.manual_seed(5)
    sc = make_scorer("gsa", H, D, BS, select=select)
    sc.fit(torch.randn(H, 20 * BS, D), torch.randn(H, 16, D))
    params = torch.stack([sc.batch_params()] * 4)  # (S, H, D, r)
    q = torch.randn(4, H, G, D)
    got = sc.select_weights_with(q, params)
    want = sc.ranking_weights_with(q, params)
    if select == "mixed":
        want = torch.cat([want, sc.bound_weights_with(q.mean(dim=-2, keepdim=True), params)], dim=-2)
    assert got.shape == want.shape == (4, H, G + (select == "mixed"), sc.row_width)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
