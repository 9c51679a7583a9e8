"""The passkey prompt set of ``kvfabric bench sparse-vllm`` and the comparison of a
method's answers with dense's: keys found, token-identical answers, and the KL at the
first sparse-decoded token from vLLM's top-k logprobs (``bench/sparse_vllm.py``'s
docstring has the method; this module holds no engine)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

FILLERS = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ",
    "A river runs through the old town. Boats pass under the bridges. People walk along the water. ",
    "Numbers and letters fill the page. Nothing here is worth remembering. Keep reading anyway. ",
)
NEEDLES = (
    "\nThe pass key is {key}. Remember it. {key} is the pass key.\n",
    "\nThe pass key is {key}. Remember it.\n",
    "\nImportant: the pass key is {key}. The pass key is {key}.\n",
)
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)


@dataclass(frozen=True)
class PromptSpec:
    """One passkey prompt: about ``tokens`` tokens, key from ``seed`` at ``depth``, in
    ``FILLERS[filler]`` with the needle ``NEEDLES[needle]``."""

    tokens: int
    seed: int
    depth: float
    filler: int
    needle: int


@dataclass(frozen=True)
class FirstDecode:
    """One engine's answer to one prompt: its tokens and the top-k logprobs
    (token id -> logprob) of the first token decoded with sparse attention (position 1)."""

    tokens: tuple[int, ...]
    logprobs: dict[int, float]


@dataclass(frozen=True)
class Accuracy:
    """A method against dense over one prompt set (see the module docstring)."""

    prompts: int
    dense_found: int
    found: int
    passkeys_lost: int
    answers_match_dense: float
    kl_mean: float
    kl_max: float
    kl_outside_mass_max: float


def prompt_specs(tokens: int, count: int, offset: int = 0) -> list[PromptSpec]:
    """``count`` prompts of about ``tokens`` tokens cycling through depths, fillers and
    needle formats (seeds ``offset``, ``offset + 1``, ...); deterministic."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    return [
        PromptSpec(
            tokens,
            offset + i,
            DEPTHS[i % len(DEPTHS)],
            i % len(FILLERS),
            (i // len(FILLERS)) % len(NEEDLES),
        )
        for i in range(count)
    ]


def build_prompt(tok: Any, spec: PromptSpec) -> Any:
    """The :class:`~kvfabric.harness.sparse.passkey.Passkey` of ``spec``."""
    from kvfabric.harness.sparse.passkey import passkey_prompt

    return passkey_prompt(
        tok,
        spec.tokens,
        seed=spec.seed,
        depth=spec.depth,
        filler=FILLERS[spec.filler],
        needle=NEEDLES[spec.needle],
    )


def coarse_kl(p: dict[int, float], q: dict[int, float]) -> tuple[float, float]:
    """KL(p || q) in nats of two top-k logprob maps coarsened to their shared tokens plus one
    bucket for the rest, and p's mass in that bucket. A lower bound of the full KL."""
    shared = p.keys() & q.keys()
    pp = {t: math.exp(p[t]) for t in shared}
    qq = {t: math.exp(q[t]) for t in shared}
    kl = sum(pp[t] * (p[t] - q[t]) for t in shared)
    p_rest, q_rest = max(0.0, 1.0 - sum(pp.values())), max(0.0, 1.0 - sum(qq.values()))
    if p_rest > 1e-12:
        kl += p_rest * (math.log(p_rest) - math.log(max(q_rest, 1e-12)))
    return max(0.0, kl), p_rest


def accuracy(
    answers: Sequence[str],
    dense: Sequence[FirstDecode],
    dense_text: Sequence[str],
    method: Sequence[FirstDecode],
    method_text: Sequence[str],
) -> Accuracy:
    """``method`` against ``dense`` on the same prompts (in order): keys found (the first
    number of the answer text equals ``answers[i]``), token-identical answers, KL at the
    first sparse-decoded position (:func:`coarse_kl`)."""
    from kvfabric.harness.sparse.passkey import digits

    n = len(answers)
    if not n or not (len(dense) == len(dense_text) == len(method) == len(method_text) == n):
        raise ValueError("accuracy needs one dense and one method answer per prompt, at least one prompt")
    d_ok = [digits(t) == a for t, a in zip(dense_text, answers)]
    m_ok = [digits(t) == a for t, a in zip(method_text, answers)]
    kls = [coarse_kl(d.logprobs, m.logprobs) for d, m in zip(dense, method)]
    return Accuracy(
        prompts=n,
        dense_found=sum(d_ok),
        found=sum(m_ok),
        passkeys_lost=sum(d and not m for d, m in zip(d_ok, m_ok)),
        answers_match_dense=sum(d.tokens == m.tokens for d, m in zip(dense, method)) / n,
        kl_mean=sum(k for k, _ in kls) / n,
        kl_max=max(k for k, _ in kls),
        kl_outside_mass_max=max(r for _, r in kls),
    )


__all__ = [
    "DEPTHS",
    "FILLERS",
    "NEEDLES",
    "Accuracy",
    "FirstDecode",
    "PromptSpec",
    "accuracy",
    "build_prompt",
    "coarse_kl",
    "prompt_specs",
]
