"""A synthetic but realistic decode-attention workload, calibrated and self-describing.

Keys per KV head: a non-zero mean with a few outlier channels (large offset and variance,
in low-frequency rotary dims),
plus a low-rank part driven by latent factors that are locally correlated along positions
(an exponential moving average of white noise), plus white noise; then RoPE at their
positions. Queries: a per-head base, a per-query-head deviation inside the GQA group and a
drift that accumulates across decode steps; RoPE at the decode positions. Logits are then
scaled to a target spread per head type, and structure is planted in key space along each
head's mean query direction ``u`` (a key moved by ``a u`` gains ``a (q.u) / sqrt(D)`` logits):

* attention sinks at the first tokens, recency bias over the last tokens;
* retrieval heads: single-token needles, one span needle, isolated distractors (a bit
  weaker than a needle) and distractor spans (many moderately raised tokens);
* head types: ``streaming`` (sink + recency dominate), ``retrieval`` (needles), ``diffuse``
  (flat logits, mass spread everywhere).

Each planted item's logit boost is set from the mass it should take against ``N`` ordinary
keys (``log(m / (1 - m)) + log N + sigma^2 / 2``), so the statistics hold at every context
length. ``stats()`` reports the mass in the top 2% of tokens and the sink mass per head type;
the benchmark prints them with every run.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

from kvfabric.harness.sparse.rope import apply_rope, rope_tables
from kvfabric.settings import coerce_fields, setting


class HeadType(enum.Enum):
    STREAMING = "streaming"
    RETRIEVAL = "retrieval"
    DIFFUSE = "diffuse"


#: per head type: (logit std, sink mass, recent mass)
_PROFILE = {
    HeadType.STREAMING: (2.0, 0.50, 0.30),
    HeadType.RETRIEVAL: (2.5, 0.15, 0.10),
    HeadType.DIFFUSE: (1.2, 0.05, 0.05),
}


@dataclass(frozen=True)
class SyntheticConfig:
    """The workload's shape and statistics (each key checked like every kvfabric config)."""

    context: int = setting(32768, lo=1024, doc="tokens in the KV cache")
    head_dim: int = setting(128, lo=2, doc="an even head dimension")
    group: int = setting(4, lo=1, doc="query heads per KV head")
    heads_per_type: int = setting(2, lo=1, doc="KV heads of each head type")
    steps: int = setting(4, lo=1, doc="decode steps (queries) per head")
    needles: int = setting(4, lo=1, hi=64, doc="single-token needles per retrieval head")
    span_len: int = setting(24, lo=1, hi=63, doc="tokens of the span needle and the distractor spans")
    distractors: int = setting(16, lo=0, doc="isolated distractors per retrieval head")
    distractor_spans: int = setting(4, lo=0, doc="distractor spans per retrieval head")
    needle_mass: float = setting(0.6, gt=0, hi=1, doc="total mass of a retrieval head's needles")
    drift: float = setting(0.02, lo=0, hi=1, doc="fraction of the query's variance replaced per step")
    rope_base: float = setting(500000.0, gt=0, doc="RoPE base")
    seed: int = setting(0, doc="seed of every random draw")
    # prompt queries (what a prefill gives the scorer): offset and per-token fluctuation
    # around the head's persistent query, calibrated on SmolLM2's captured queries (see stats)
    prompt_offset: float = setting(1.9, lo=0, doc="prompt queries: the offset shared by the prompt")
    prompt_noise: float = setting(0.4, lo=0, doc="prompt queries: the per-token fluctuation")
    # "query": needles and distractors are moved along the head's mean query direction (a
    # direction keys need not vary along); "keys": along that direction's projection on the
    # keys' top principal directions (a needle key that is an ordinary key of the head,
    # as keys made by the model's own projection are)
    needle_kind: str = setting("query", choices=("query", "keys"), doc="how needles are planted")

    def __post_init__(self) -> None:
        coerce_fields(self, lambda key: f"synthetic workload {key}")
        if self.head_dim % 2:
            raise ValueError(f"synthetic workload head_dim={self.head_dim}: expected an even number")


@dataclass(frozen=True)
class Workload:
    """``q (S, H, G, D)`` decode queries, ``k, v (H, N, D)``; needles as (head, first, last)
    positions; ``prompt_q (H, M * G, D)``: queries of ``M`` prompt positions ``prompt_pos``
    (ascending; half spread over the prompt, half in its last 256 tokens), grouped by KV head
    with the ``G`` query heads of a position consecutive (what a prefill gives a scorer)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    head_types: tuple[HeadType, ...]
    needles: tuple[tuple[int, int, int], ...]
    config: SyntheticConfig
    prompt_q: torch.Tensor
    prompt_pos: torch.Tensor

    def recent_prompt_q(self, window: int) -> torch.Tensor:
        """``(H, m * G, D)``: the prompt queries of the last ``window`` positions (all when
        ``window`` is 0)."""
        keep = self.prompt_pos >= self.k.shape[1] - window if window else self.prompt_pos >= 0
        g = self.config.group
        h, _, d = self.prompt_q.shape
        return self.prompt_q.reshape(h, -1, g, d)[:, keep].reshape(h, -1, d).contiguous()


def _boost(mass: float, n: int, sigma: float) -> float:
    m = min(max(mass, 1e-6), 0.999)
    return math.log(m / (1 - m)) + math.log(n) + sigma * sigma / 2


def _smooth(noise: torch.Tensor, rho: float, taps: int = 64) -> torch.Tensor:
    """Exponential moving average along dim 0 of ``(n, m)`` (unit variance kept)."""
    w = rho ** torch.arange(taps - 1, -1, -1, dtype=torch.float32)
    w = w / w.norm()
    x = noise.t().unsqueeze(1)  # (m, 1, n)
    y = torch.nn.functional.conv1d(torch.nn.functional.pad(x, (taps - 1, 0)), w.view(1, 1, -1))
    return y.squeeze(1).t()


def _semantic_basis(d: int, m: int, gen: torch.Generator) -> torch.Tensor:
    """``(d, m)`` orthonormal directions inside the lowest-frequency half of the rotary
    pairs (rotate-half layout: pair ``(i, i + d/2)`` turns slower as ``i`` grows), where
    RoPE barely moves them: the directions along which keys vary and queries look."""
    half, pairs = d // 2, d // 4
    dims = torch.cat([torch.arange(half - pairs, half), torch.arange(d - pairs, d)])
    basis = torch.zeros((d, m))
    basis[dims] = torch.linalg.qr(torch.randn((2 * pairs, m), generator=gen))[0]
    return basis


def _base_keys(n: int, d: int, basis: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    m = basis.shape[1]
    z = _smooth(torch.randn((n, m), generator=gen), rho=0.95)
    scales = 2.0 * torch.arange(1, m + 1, dtype=torch.float32) ** -0.7
    mu = torch.randn(d, generator=gen) * 0.6
    # massive key channels sit in low-frequency rotary dims (as observed in trained models),
    # where RoPE barely turns them: near-constant offsets along a few directions
    low = torch.cat([torch.arange(d // 2 - 8, d // 2), torch.arange(d - 8, d)])
    outliers = low[torch.randperm(16, generator=gen)[:4]]
    mu[outliers] += 6.0 * torch.sign(torch.randn(4, generator=gen))
    k = mu + (z * scales) @ basis.t() + 0.3 * torch.randn((n, d), generator=gen)
    k[:, outliers] += 1.5 * torch.randn((n, 4), generator=gen)
    return k


def _sem(basis: torch.Tensor, gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Random vectors in the semantic directions (decaying weights)."""
    m = basis.shape[1]
    w = torch.arange(1, m + 1, dtype=torch.float32) ** -0.5
    return (torch.randn((*shape, m), generator=gen) * w) @ basis.t()


def _queries(
    basis: torch.Tensor, g: int, steps: int, drift: float, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(G, S, D)`` pre-RoPE decode queries: mostly along the semantic directions (shared
    base, per-head deviation, drift across steps), plus some energy everywhere; and the
    head's persistent part ``base + dev`` ``(G, D)``."""
    d = basis.shape[0]
    base = _sem(basis, gen, 1) + 0.05 * torch.randn((1, d), generator=gen)
    dev = 0.4 * _sem(basis, gen, g)
    cur = torch.zeros((g, d))
    out = []
    for _ in range(steps):
        cur = math.sqrt(1 - drift) * cur + math.sqrt(drift) * (
            _sem(basis, gen, g) + 0.05 * torch.randn((g, d), generator=gen)
        )
        out.append(base + dev + cur)
    return torch.stack(out, 1), base + dev


def _prompt_queries(
    basis: torch.Tensor, persistent: torch.Tensor, m: int, offset: float, noise: float, gen: torch.Generator
) -> torch.Tensor:
    """``(M, G, D)`` pre-RoPE queries of ``m`` prompt positions: the head's persistent part,
    a per-head offset shared by the whole prompt (prompt tokens do not ask what the answer
    asks), and a per-token fluctuation, both in the semantic directions."""
    g, d = persistent.shape
    shift = offset * _sem(basis, gen, g)
    tokens = noise * _sem(basis, gen, m, g) + 0.05 * torch.randn((m, g, d), generator=gen)
    return persistent + shift + tokens


def generate(cfg: SyntheticConfig) -> Workload:
    gen = torch.Generator().manual_seed(cfg.seed)
    n, d, g, s = cfg.context, cfg.head_dim, cfg.group, cfg.steps
    types = tuple(t for t in HeadType for _ in range(cfg.heads_per_type))
    cos_k, sin_k = rope_tables(torch.arange(n), d, cfg.rope_base)
    cos_q, sin_q = rope_tables(torch.arange(n, n + s), d, cfg.rope_base)
    ks, qs, vs, pqs, needles = [], [], [], [], []
    ppos = torch.cat([torch.linspace(0, n - 257, 64).long(), torch.arange(n - 256, n, 4)])
    cos_p, sin_p = rope_tables(ppos, d, cfg.rope_base)
    for h, ht in enumerate(types):
        sigma, sink_mass, recent_mass = _PROFILE[ht]
        basis = _semantic_basis(d, 24, gen)
        k = apply_rope(_base_keys(n, d, basis, gen), cos_k, sin_k)
        q_pre, persistent = _queries(basis, g, s, cfg.drift, gen)
        q = apply_rope(q_pre, cos_q, sin_q).transpose(0, 1)  # (S, G, D)
        pgen = torch.Generator().manual_seed(cfg.seed * 7919 + h)  # its own stream
        pq_pre = _prompt_queries(basis, persistent, len(ppos), cfg.prompt_offset, cfg.prompt_noise, pgen)
        pq = apply_rope(pq_pre.transpose(0, 1), cos_p, sin_p).transpose(0, 1).reshape(-1, d)  # (M*G, D)
        # scale the queries so that ordinary logits have the head type's spread
        logits = torch.matmul(q[0], k[:: max(1, n // 4096)].t()) / math.sqrt(d)
        q_scale = sigma / logits.std().clamp(min=1e-6)
        q = q * q_scale
        pqs.append(pq * q_scale)
        u = q.mean(dim=(0, 1))
        u = u / u.norm()
        per_logit = math.sqrt(d) / float((q @ u).mean())  # key shift along u per logit

        def plant(
            pos: torch.Tensor,
            logit: torch.Tensor | float,
            k: torch.Tensor = k,
            u: torch.Tensor = u,
            p: float = per_logit,
        ) -> None:
            k[pos] += (torch.as_tensor(logit, dtype=torch.float32).reshape(-1, 1) * p) * u

        plant(torch.arange(4), _boost(sink_mass, n, sigma) - torch.log(torch.tensor([1.0, 3.0, 6.0, 10.0])))
        dist = torch.arange(64, dtype=torch.float32)
        plant(torch.arange(n - 64, n), _boost(recent_mass / 10, n, sigma) - dist.flip(0) / 8)
        if ht is HeadType.RETRIEVAL:
            if cfg.needle_kind == "keys":
                sample = k[:: max(1, n // 8192)].double()
                top = torch.linalg.eigh(sample.t() @ sample)[1][:, -32:].float()
                un = top @ (top.t() @ u)
                un = un / un.norm()
                pl = math.sqrt(d) / float((q @ un).mean())

                def plant_needle(
                    pos: torch.Tensor,
                    logit: float,
                    k: torch.Tensor = k,
                    un: torch.Tensor = un,
                    pl: float = pl,
                ) -> None:
                    k[pos] += (logit * pl) * un
            else:
                plant_needle = plant
            lo, hi = 64, n - 256
            slots = (
                torch.randperm((hi - lo) // 64, generator=gen)[
                    : cfg.needles + 1 + cfg.distractors + cfg.distractor_spans
                ]
                * 64
                + lo
            )
            pos = slots + torch.randint(0, 64 - cfg.span_len, (len(slots),), generator=gen)
            each = cfg.needle_mass / (cfg.needles + 1)
            for p in pos[: cfg.needles]:
                plant_needle(p.view(1), _boost(each, n, sigma))
                needles.append((h, int(p), int(p)))
            sp = int(pos[cfg.needles])
            plant_needle(torch.arange(sp, sp + cfg.span_len), _boost(each / cfg.span_len * 2, n, sigma))
            needles.append((h, sp, sp + cfg.span_len - 1))
            rest = pos[cfg.needles + 1 :]
            for p in rest[: cfg.distractors]:
                plant_needle(p.view(1), _boost(each, n, sigma) - 1.5)
            for p in rest[cfg.distractors :]:
                plant_needle(torch.arange(int(p), int(p) + 16), _boost(each, n, sigma) - 3.0)
        ks.append(k)
        qs.append(q)
        vs.append(torch.randn((n, d), generator=gen) + 0.5)
    return Workload(
        q=torch.stack(qs, 1).contiguous(),
        k=torch.stack(ks).contiguous(),
        v=torch.stack(vs).contiguous(),
        head_types=types,
        needles=tuple(needles),
        config=cfg,
        prompt_q=torch.stack(pqs).contiguous(),
        prompt_pos=ppos,
    )


def attention_stats(q: torch.Tensor, k: torch.Tensor, sink_tokens: int = 16) -> dict[str, torch.Tensor]:
    """Per query head ``(H, G)``: mass of the top 2% of tokens and of the first
    ``sink_tokens`` tokens, for ``q (H, G, D)``, ``k (H, N, D)``."""
    p = torch.softmax(torch.matmul(q, k.transpose(1, 2)) / math.sqrt(q.shape[-1]), dim=-1)
    top = max(1, int(0.02 * p.shape[-1]))
    return {
        "top2pct_mass": torch.topk(p, top, dim=-1).values.sum(-1),
        "sink_mass": p[..., :sink_tokens].sum(-1),
    }


def query_similarity(decode_q: torch.Tensor, prompt_q: torch.Tensor) -> dict[str, float]:
    """How much the prompt's queries tell about the decode queries, per KV head group:
    ``q_cos_mean``, the median cosine of a decode query ``(H, S, D)`` with the mean of the
    prompt queries ``(H, M, D)`` of its KV head, and ``q_cos_token``, the median cosine of a
    decode query with one prompt query."""
    a = torch.nn.functional.normalize(decode_q, dim=-1)
    mean = torch.nn.functional.normalize(prompt_q.mean(1, keepdim=True), dim=-1)
    tok = torch.matmul(a, torch.nn.functional.normalize(prompt_q, dim=-1).transpose(1, 2))
    return {"q_cos_mean": float((a * mean).sum(-1).median()), "q_cos_token": float(tok.median())}


def stats(w: Workload, window: int = 256) -> dict[str, float]:
    """Median statistics (step 0) per head type and overall, and the similarity of the
    decode queries with the prompt queries of the last ``window`` positions."""
    st = attention_stats(w.q[0], w.k)
    h, d = w.k.shape[0], w.k.shape[2]
    out: dict[str, float] = query_similarity(
        w.q.permute(1, 0, 2, 3).reshape(h, -1, d), w.recent_prompt_q(window)
    )
    for name, val in st.items():
        out[name] = float(val.median())
        for ht in HeadType:
            idx = [i for i, t in enumerate(w.head_types) if t is ht]
            if idx:
                out[f"{name}_{ht.value}"] = float(val[idx].median())
    return out


__all__ = [
    "HeadType",
    "SyntheticConfig",
    "Workload",
    "attention_stats",
    "generate",
    "query_similarity",
    "stats",
]
