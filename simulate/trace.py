"""Request traces: JSONL files (three forms) and the synthetic generator.

Contract: a trace is an iterator of :class:`Request` in arrival order (a file out of order
is refused at the first request that goes back in time, naming its line). Nothing is
read ahead, so a trace of any length replays in bounded memory.

Line forms (one JSON object per line; blank lines skipped):

* **token ids**: ``{"arrival_s": 0.5, "tokens": [1, 2, ...], "output_tokens": 16}``; the
  block keys are kvfabric's block ids of the tokens (``ucm_layer/hashing.py``'s
  :class:`~kvfabric.ucm_layer.hashing.BlockHasher`, one per full block), so two prompts
  share exactly the blocks the connector would find shared.
* **block hashes**: ``{"arrival_s": 0.5, "hash_ids": [7, 8, 9], "prompt_tokens": 1500,
  "output_tokens": 16}``; the keys are the hashes as given (the first ``k`` equal means
  the first ``k`` blocks are shared).
* **Mooncake FAST'25** (``timestamp`` in ms, ``input_length``, ``output_length``,
  ``hash_ids`` per 512-token block): read as block hashes, ``arrival_s = timestamp /
  1000``.

A request's ``keys`` are its prompt's block keys; the last may cover a partial block
(hash-id forms); the replay looks up and stores only full blocks.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from kvfabric.simulate.config import SyntheticConfig
from kvfabric.ucm_layer.hashing import BlockHasher, Fingerprint


@dataclass(frozen=True, slots=True)
class Request:
    """One request: when it arrives, its prompt's block keys and lengths."""

    arrival_s: float
    keys: Sequence[Hashable]
    prompt_tokens: int
    output_tokens: int


def default_hasher(block_tokens: int) -> BlockHasher:
    """The hasher token-id traces are keyed with when no fingerprint is given."""
    return BlockHasher(Fingerprint("sim", "any", "sim", block_tokens))


def _field(obj: dict, name: str, where: str, kind: type | tuple[type, ...]) -> object:
    if name not in obj:
        raise ValueError(f"{where}: missing {name!r}")
    v = obj[name]
    if isinstance(v, bool) or not isinstance(v, kind):
        raise ValueError(f"{where}: {name}={v!r} is not a {getattr(kind, '__name__', 'number')}")
    return v


def _count(obj: dict, name: str, where: str, default: int | None = None) -> int:
    if name not in obj and default is not None:
        return default
    v = _field(obj, name, where, int)
    if v < 0:  # type: ignore[operator]
        raise ValueError(f"{where}: {name}={v} must be >= 0")
    return int(v)  # type: ignore[arg-type]


def parse_line(obj: object, where: str, block_tokens: int, hasher: BlockHasher | None) -> Request:
    """One trace line (already JSON-decoded) as a :class:`Request`; ``ValueError`` naming
    ``where`` and the field when it is not one of the three forms."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: a trace line is a JSON object, got {type(obj).__name__}")
    if "timestamp" in obj:  # Mooncake FAST'25
        ts = _field(obj, "timestamp", where, (int, float))
        hashes = _field(obj, "hash_ids", where, list)
        n_in = _count(obj, "input_length", where)
        n_out = _count(obj, "output_length", where)
        return Request(float(ts) / 1000.0, hashes, n_in, n_out)  # type: ignore[arg-type]
    arrival = float(_field(obj, "arrival_s", where, (int, float)))  # type: ignore[arg-type]
    if not math.isfinite(arrival) or arrival < 0:
        raise ValueError(f"{where}: arrival_s={arrival} must be a finite number >= 0")
    n_out = _count(obj, "output_tokens", where, default=1)
    if "tokens" in obj:
        tokens = _field(obj, "tokens", where, list)
        h = hasher or default_hasher(block_tokens)
        ids = h.hash_tokens(tokens)  # type: ignore[arg-type]
        if len(ids) < len(tokens) // h.block_size:  # type: ignore[arg-type]
            raise ValueError(f"{where}: tokens must be unsigned 32-bit integers")
        raw = ids.tobytes()
        keys = [raw[i : i + 16] for i in range(0, len(raw), 16)]
        return Request(arrival, keys, len(tokens), n_out)  # type: ignore[arg-type]
    if "hash_ids" in obj:
        hashes = _field(obj, "hash_ids", where, list)
        n_in = _count(obj, "prompt_tokens", where, default=len(hashes) * block_tokens)  # type: ignore[arg-type]
        return Request(arrival, hashes, n_in, n_out)  # type: ignore[arg-type]
    raise ValueError(f"{where}: a trace line needs 'tokens', 'hash_ids' or Mooncake's 'timestamp'")


def read_jsonl(
    path: str | os.PathLike[str], block_tokens: int, hasher: BlockHasher | None = None
) -> Iterator[Request]:
    """The requests of a JSONL trace file, in order (see module docstring)."""
    last = -math.inf
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"trace {os.fspath(path)} line {n}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON: {e}") from None
            req = parse_line(obj, where, block_tokens, hasher)
            if req.arrival_s < last:
                raise ValueError(f"{where}: arrives at {req.arrival_s} s, before the line above ({last} s)")
            last = req.arrival_s
            yield req


def count_lines(path: str | os.PathLike[str]) -> int:
    """Non-blank lines of a trace file (the progress bar's total)."""
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


# ---------------------------------------------------------------------------- synthetic
_SYSTEM = 1 << 60  # block keys of the system prompt: _SYSTEM + j
_PREFIX_SHIFT = 24  # prefix p, block j: (p + 1) << 24 | j  (prefixes < 2**35, blocks < 2**24)


def _lognormal(rng: np.random.Generator, mean: float, sigma: float, n: int) -> np.ndarray:
    if sigma == 0:
        return np.full(n, mean)
    return rng.lognormal(math.log(mean) - sigma * sigma / 2, sigma, n)  # E[x] = mean


def synthetic(cfg: SyntheticConfig, block_tokens: int, chunk: int = 65536) -> Iterator[Request]:
    """``cfg.requests`` requests (see :class:`SyntheticConfig`), generated ``chunk`` at a
    time from ``cfg.seed``: the same configuration always gives the same trace. Keys are
    ints in the block-hash form; suffix keys are unique to their request."""
    rng = np.random.default_rng(cfg.seed)
    ranks = np.arange(1, cfg.prefixes + 1, dtype=np.float64)
    weights = ranks**-cfg.zipf_s
    cdf = np.cumsum(weights / weights.sum())
    prefix_len = np.maximum(1, _lognormal(rng, cfg.prefix_tokens_mean, cfg.prefix_tokens_sigma, cfg.prefixes))
    prefix_len = prefix_len.astype(np.int64)
    sys_blocks = cfg.system_tokens // block_tokens
    system = [_SYSTEM + j for j in range(sys_blocks)]
    unique = 1 << 62  # suffix keys count up from here
    t = 0.0
    done = 0
    two_pi = 2 * math.pi / cfg.diurnal_period_s
    while done < cfg.requests:
        n = min(chunk, cfg.requests - done)
        gaps = rng.exponential(1.0, n)
        which = np.minimum(np.searchsorted(cdf, rng.random(n)), cfg.prefixes - 1)
        suffix = np.maximum(1, _lognormal(rng, cfg.suffix_tokens_mean, cfg.suffix_tokens_sigma, n)).astype(
            int
        )
        out = np.maximum(1, _lognormal(rng, cfg.output_tokens_mean, cfg.output_tokens_sigma, n)).astype(int)
        for i in range(n):
            rate = cfg.qps * (1 + cfg.diurnal_swing * math.sin(two_pi * t))
            t += gaps[i] / rate
            p = int(which[i])
            prompt = min(cfg.system_tokens + int(prefix_len[p]) + int(suffix[i]), cfg.max_prompt_tokens)
            nblocks = -(-prompt // block_tokens)
            base = (p + 1) << _PREFIX_SHIFT
            shared_end = (cfg.system_tokens + int(prefix_len[p])) // block_tokens  # full shared blocks
            keys = system[: min(sys_blocks, nblocks)]
            keys = keys + list(range(base, base + max(0, min(shared_end, nblocks) - sys_blocks)))
            extra = nblocks - len(keys)
            if extra > 0:
                keys.extend(range(unique, unique + extra))
                unique += extra
            yield Request(t, keys, prompt, int(out[i]))
        done += n


__all__ = ["Request", "count_lines", "default_hasher", "parse_line", "read_jsonl", "synthetic"]
