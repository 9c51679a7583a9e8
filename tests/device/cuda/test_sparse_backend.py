"""The CUDA path of kvfabric's vLLM sparse backend on a real NVIDIA GPU (skipped without
one). vLLM is not needed: the block-table rewrite the FlashAttention wrapper hands the
stock kernel (``rewrite.replace_rows``) runs on device tensors here, and paged attention
over the rewritten rows (torch, FlashAttention's cache layout) equals attention over
exactly the union of the heads' selected blocks."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from kvfabric.ucm_layer.sparse.vllm.rewrite import fold_heads, replace_rows  # noqa: E402

H, G, D, BS = 2, 4, 64, 16
DEV = "cuda"


def _paged(q: torch.Tensor, cache: torch.Tensor, row: torch.Tensor, seq: int) -> torch.Tensor:
    """Attention of ``q (H*G, D)`` over the first ``seq`` tokens of block-table ``row`` in a
    FlashAttention-layout cache ``(2, num_blocks, block_size, H, D)``."""
    nb = -(-seq // BS)
    k = cache[0, row[:nb].long()].reshape(-1, H, D)[:seq]
    v = cache[1, row[:nb].long()].reshape(-1, H, D)[:seq]
    qh = q.view(H, G, D)
    p = torch.softmax(torch.einsum("hgd,thd->hgt", qh, k) / math.sqrt(D), dim=-1)
    return torch.einsum("hgt,thd->hgd", p, v).reshape(H * G, D)


def test_replace_rows_on_the_device_reads_the_union_of_the_heads_blocks() -> None:
    torch.manual_seed(0)
    num_blocks, seq = 40, 10 * BS + 7  # 11 logical blocks, the last one partial
    cache = torch.randn(2, num_blocks, BS, H, D, device=DEV)
    physical = torch.randperm(num_blocks, device=DEV)[:11].to(torch.int32)
    block_table = torch.zeros(2, 16, dtype=torch.int32, device=DEV)
    block_table[0, :11] = physical
    block_table[1, :11] = physical.flip(0)
    seq_lens = torch.tensor([seq, seq], dtype=torch.int32, device=DEV)
    logical = torch.tensor([[0, 3, 10], [0, 6, 10]], device=DEV)
    lens = torch.tensor([[BS, BS, 7], [BS, BS, 7]], device=DEV)
    bt, sl = replace_rows(block_table, seq_lens, {0: (physical.long()[logical], lens)})
    assert bt.device.type == "cuda" and int(sl[0]) == 3 * BS + 7 and int(sl[1]) == seq
    assert torch.equal(bt[1], block_table[1])
    assert int(bt[0, 3]) == int(physical[10])  # the partial block comes last
    q = torch.randn(H * G, D, device=DEV)
    union = torch.tensor([0, 3, 6, 10], device=DEV)
    want = _paged(q, cache, physical[union], 3 * BS + 7)
    torch.testing.assert_close(_paged(q, cache, bt[0], int(sl[0])), want)
    torch.testing.assert_close(_paged(q, cache, bt[1], int(sl[1])), _paged(q, cache, block_table[1], seq))


def test_fold_heads_on_the_device() -> None:
    tables = torch.tensor([[[4, 9, 2], [4, 1, 2]]], device=DEV)
    lens = torch.tensor([[[BS, 5, BS], [BS, BS, 0]]], device=DEV)
    bt, seq = fold_heads(tables, lens)
    assert bt.device.type == "cuda" and seq.tolist() == [2 * BS + 5, 2 * BS]
    assert bt[0].tolist() == [4 * H, 2 * H, 9 * H] and bt[1, :2].tolist() == [4 * H + 1, 1 * H + 1]
