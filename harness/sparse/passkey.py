"""Passkey retrieval prompts for SmolLM2 and the decode-loop checks run on them.

A prompt hides ``The pass key is NNNNN. Remember it. NNNNN is the pass key.`` at a given
depth inside repeated filler text, asks for the key in the chat format, and opens the
answer with ``The pass key is``; greedy decoding should continue with the digits.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from typing import Any

import torch

from kvfabric.harness.sparse.engine import PagedEngine
from kvfabric.harness.sparse.llama import Capture, Llama
from kvfabric.harness.sparse.model import Tokenizer
from kvfabric.ucm_layer.sparse.base import ModelSpec, create

_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
_INTRO = (
    "There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the pass key later.\n"
)


@dataclass(frozen=True)
class Passkey:
    ids: list[int]
    answer: str
    needle_tokens: tuple[int, int]  # first and last token of the needle sentence


#: the needle sentence (``{key}`` is replaced by the key)
NEEDLE = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"


def passkey_prompt(
    tok: Tokenizer,
    tokens: int,
    seed: int = 0,
    depth: float = 0.5,
    filler: str = _FILLER,
    needle: str = NEEDLE,
) -> Passkey:
    """A prompt of about ``tokens`` tokens with a 5-digit key at ``depth`` (0 = start),
    hidden in repeats of ``filler`` as the ``needle`` template (``{key}`` replaced)."""
    if "{key}" not in needle:
        raise ValueError(f"needle template {needle!r} has no {{key}}")
    rng = random.Random(seed)
    key = str(rng.randint(10000, 99999))
    needle = needle.format(key=key)
    head = tok.encode(tok.chat(_INTRO).split(_INTRO)[0] + _INTRO)
    tail = tok.encode("\nWhat is the pass key?<|im_end|>\n<|im_start|>assistant\nThe pass key is")
    fill = tok.encode(filler)
    n_fill = max(1, (tokens - len(head) - len(tail) - 30) // len(fill))
    before = round(n_fill * depth)
    ids_before = head + fill * before
    needle_ids = tok.encode(needle)
    ids = ids_before + needle_ids + fill * (n_fill - before) + tail
    return Passkey(ids, key, (len(ids_before), len(ids_before) + len(needle_ids) - 1))


def digits(text: str) -> str:
    m = re.search(r"\d+", text)
    return m.group(0) if m else ""


def spec_for(model: Llama, block_size: int) -> ModelSpec:
    c = model.cfg
    return ModelSpec(c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, block_size)


def prefill(model: Llama, pk: Passkey, capture_last: int = 4) -> Capture:
    """Dense prefill of all but the last prompt token, capturing q/k/v."""
    _, cap = model.prefill(torch.tensor(pk.ids[:-1]), capture_last=capture_last)
    if cap is None:
        raise RuntimeError("prefill returned no capture")
    return cap


def answer(
    model: Llama,
    tok: Tokenizer,
    pk: Passkey,
    cap: Capture,
    method: str,
    config: dict,
    block_size: int = 16,
    max_new: int = 7,
    forced: list[int] | None = None,
    all_logits: list[torch.Tensor] | None = None,
    **plugin_kwargs: Any,
) -> tuple[str, torch.Tensor, dict[str, float]]:
    """Greedy answer of ``method`` through the engine's hooks, the logits of the first
    answer token, and the plugin's statistics. The prompt's KV comes from ``cap`` (a dense
    prefill of all but its last token); the last prompt token runs as a decode step, so its
    attention, and the first answer token, already go through the plugin. With ``forced``
    (token ids), those tokens are fed instead of the greedy ones (teacher forcing: every
    step sees the same prefix as the run that produced them); ``all_logits``, if given,
    receives the logits of every answer position."""
    plugin = create(method, spec_for(model, block_size), config, **plugin_kwargs)
    nblocks = -(-(len(pk.ids) + max_new) // block_size) + 2
    eng = PagedEngine(model, plugin, num_blocks=nblocks, block_size=block_size)
    eng.add_prefilled("r", pk.ids[:-1], cap.k, cap.v, cap.q_prompt, cap.stride)
    first = eng.decode(["r"], [pk.ids[-1]])[0]
    logits = [first]
    out = [int(first.argmax())]
    for i in range(max_new - 1):
        fed = forced[i] if forced is not None else out[-1]
        logits.append(eng.decode(["r"], [fed])[0])
        out.append(int(logits[-1].argmax()))
    eng.finish("r")
    plugin.close()
    if all_logits is not None:
        all_logits.extend(logits)
    return tok.decode(out), first, plugin.stats()


def kl_div(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """KL(p || q) of the softmax distributions, in nats."""
    lp = torch.log_softmax(p_logits.double(), -1)
    lq = torch.log_softmax(q_logits.double(), -1)
    return float((lp.exp() * (lp - lq)).sum())


def top2pct_stats(q: torch.Tensor, k: torch.Tensor) -> tuple[float, float]:
    """Median top-2% mass and first-16-token mass over heads of captured ``q (H, G, D)``."""
    p = torch.softmax(torch.matmul(q, k.transpose(1, 2)) / math.sqrt(q.shape[-1]), dim=-1)
    top = max(1, int(0.02 * p.shape[-1]))
    return float(torch.topk(p, top, -1).values.sum(-1).median()), float(p[..., :16].sum(-1).median())


__all__ = [
    "NEEDLE",
    "Passkey",
    "answer",
    "digits",
    "kl_div",
    "passkey_prompt",
    "prefill",
    "spec_for",
    "top2pct_stats",
]
