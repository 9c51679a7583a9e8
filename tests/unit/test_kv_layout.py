"""KVLayout: every KV cache shape an engine uses becomes pieces whose bytes are the block's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvfabric.ucm_layer.kv_layout import layout_from_tensors


def _bytes_of_block(layout, b: int) -> bytes:
    import ctypes

    addrs = layout.addrs([b])[0]
    return b"".join(ctypes.string_at(int(a), int(n)) for a, n in zip(addrs, layout.size))


def _expect(t: torch.Tensor, sel) -> bytes:
    return t[sel].contiguous().numpy().tobytes()


def test_cpu_whole_block_pages_are_one_piece_per_layer():
    nb = 8
    big = torch.arange(4 * nb * 2 * 32 * 64, dtype=torch.float32).view(4, nb, 2, 32, 64)
    caches = {f"l{i}": big[i] for i in range(4)}  # views into one allocation, layer-outermost
    lay = layout_from_tensors(caches, nb, {f"l{i}": 2 * 32 * 64 * 4 for i in range(4)})
    assert lay.pieces == 4 and lay.num_layers == 4
    assert lay.piece_sizes == (2 * 32 * 64 * 4,) * 4
    assert lay.block_bytes == 4 * 2 * 32 * 64 * 4
    got = _bytes_of_block(lay, 5)
    assert got == b"".join(_expect(big[i], 5) for i in range(4))


def test_cuda_kv_first_layout_gives_k_and_v_pieces():
    nb = 6
    t = torch.randn(2, nb, 16, 4, 32)  # [2, blocks, tokens, heads, head]
    lay = layout_from_tensors({"a": t, "b": t.clone()}, nb)
    assert lay.pieces == 4  # K and V per layer
    assert lay.layer_slices == ((0, 2), (2, 4))
    got = _bytes_of_block(lay, 3)
    assert got[: 16 * 4 * 32 * 4] == _expect(t, (0, 3))
    assert got[16 * 4 * 32 * 4 : 2 * 16 * 4 * 32 * 4] == _expect(t, (1, 3))


def test_ascend_separate_k_and_v_tensors_per_layer():
    nb = 5
    k = torch.randn(nb, 16, 2, 64)
    v = torch.randn(nb, 16, 2, 64)
    lay = layout_from_tensors({"layer0": (k, v)}, nb)
    assert lay.pieces == 2
    assert _bytes_of_block(lay, 4) == _expect(k, 4) + _expect(v, 4)


def test_mla_single_latent_tensor():
    nb = 7
    lat = torch.randn(nb, 16, 576, dtype=torch.bfloat16)
    lay = layout_from_tensors({"mla": lat}, nb)
    assert lay.pieces == 1 and lay.block_bytes == 16 * 576 * 2
    assert _bytes_of_block(lay, 6) == lat[6].contiguous().view(torch.uint8).numpy().tobytes()


def test_head_major_permuted_layout_is_split_into_runs():
    nb = 4
    phys = torch.randn(nb, 2, 3, 16, 8)  # physical [blocks, kv, heads, tokens, head]
    logical = phys.permute(0, 1, 3, 2, 4)  # presented as [blocks, kv, tokens, heads, head]
    lay = layout_from_tensors({"x": logical}, nb)
    # physical order makes each block one contiguous run
    assert lay.pieces == 1
    assert _bytes_of_block(lay, 2) == _expect(phys, 2)
    strided = torch.randn(nb, 64, 128, 2)[..., 0]  # every other element: a run per element
    with pytest.raises(ValueError, match="pieces"):
        layout_from_tensors({"x": strided}, nb)


def test_kernel_blocks_smaller_than_engine_blocks():
    nb = 3
    t = torch.randn(nb * 2, 4, 16, 8)  # each engine block is 2 kernel blocks
    lay = layout_from_tensors({"x": t}, nb)
    assert lay.pieces == 2
    assert _bytes_of_block(lay, 1) == _expect(t, 2) + _expect(t, 3)


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="counts the 9 KV blocks"):
        layout_from_tensors({"x": torch.zeros(4, 4)}, 9)
    with pytest.raises(TypeError, match="layer 'x'"):
        layout_from_tensors({"x": [1, 2]}, 2)
    lay = layout_from_tensors({"x": torch.zeros(4, 8)}, 4)
    with pytest.raises(ValueError, match="outside the KV cache"):
        lay.addrs([4])
    assert lay.addrs(np.array([0, 3])).shape == (2, 1)
    assert len(lay.fingerprint()) == 16


def test_signature_names_the_meaning_of_the_bytes_not_where_they_are():
    """Independent of addresses, block count and the padding between blocks; changed by
    the dimension order, the dtype, the head count and the layer count."""
    from kvfabric.ucm_layer.kv_layout import TensorGeometry

    def layers(t, n=3):
        return {f"l{i}": t for i in range(n)}

    base = layout_from_tensors(layers(torch.zeros(8, 2, 16, 32)), 8)
    assert base.signature == "3*[k1:torch.float32:2x16x32/0,1,2]"
    unit_axis = layout_from_tensors(layers(torch.zeros(8, 1, 2, 16, 32)), 8)  # the same bytes
    assert unit_axis.signature == base.signature
    assert layout_from_tensors(layers(torch.zeros(20, 2, 16, 32)), 20).signature == base.signature
    padded = torch.zeros(8, 2 * 16 * 32 + 64)[:, : 2 * 16 * 32].view(8, 2, 16, 32)
    assert layout_from_tensors(layers(padded), 8).signature == base.signature
    geometry = TensorGeometry((8, 2, 16, 32), (1024, 512, 32, 1), 4, "torch.float32")
    assert layout_from_tensors(layers(geometry), 8).signature == base.signature
    assert layout_from_tensors(layers(geometry), 8).fingerprint() == base.fingerprint()
    token_major = torch.zeros(8, 16, 2, 32).permute(0, 2, 1, 3)  # same logical shape, other order
    others = [
        layers(token_major),
        layers(torch.zeros(8, 2, 16, 32, dtype=torch.bfloat16)),
        layers(torch.zeros(8, 4, 16, 16)),
        layers(torch.zeros(8, 2, 16, 32), 4),
    ]
    sigs = {layout_from_tensors(c, 8).signature for c in others}
    assert len(sigs) == len(others) and base.signature not in sigs
    assert len({layout_from_tensors(c, 8).fingerprint() for c in others} | {base.fingerprint()}) == 5
    mixed = {"a": torch.zeros(8, 2, 16, 32), "b": torch.zeros(8, 2, 16, 32), "c": torch.zeros(8, 4, 16, 16)}
    assert (
        layout_from_tensors(mixed, 8).signature.startswith("2*[")
        and " 1*[" in layout_from_tensors(mixed, 8).signature
    )
    with pytest.raises(ValueError, match="a stride per dimension"):
        TensorGeometry((8, 2), (2,), 4, "torch.float32")
