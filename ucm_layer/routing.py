"""What a router asks a pool daemon: how much of a request's prefix the pool holds, and where.

The vLLM connector names a block of a request by ``BlockHasher(fingerprint).hash_engine``
over vLLM's own block hashes of the request (``request.block_hashes``; when a kvfabric
block spans ``k`` of vLLM's hash blocks, every ``k``-th hash, the last of each block),
tagged with the tensor-parallel rank and the KV-cache group (``hashing.tag``; rank 0 for
MLA, whose ranks share blocks), and the pool store keys each block shard
``<prefix>/`` + id + shard (``kvfabric.pool.kv_events.block_key``). A router that has
vLLM's block hashes (from vLLM's own KV events, ``BlockStored.block_hashes``, or its own
copy of vLLM's hashing over the token ids) and the engine's fingerprint (logged by the
connector at start: ``docs/hashing.md``) computes the same ids here, without vLLM, and asks
the daemon's ``POST /prefix`` (``pool/service/prefix.py``) with them.

Call order: ``pool_block_ids`` (pure), then ``held_prefix`` (one HTTP request; raises
``ValueError`` with the daemon's message for a 400, ``OSError`` when it does not answer).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvfabric.ucm_layer import hashing


def pool_block_ids(
    fingerprint: hashing.Fingerprint,
    vllm_block_hashes: Sequence[bytes | int],
    hashes_per_block: int = 1,
    rank: int = 0,
    group: int = 0,
) -> np.ndarray:
    """The connector's ids of a request's full blocks: an ``(n, 16)`` uint8 array."""
    if isinstance(hashes_per_block, bool) or not isinstance(hashes_per_block, int) or hashes_per_block < 1:
        raise ValueError(f"hashes_per_block must be an int >= 1, got {hashes_per_block!r}")
    k = hashes_per_block
    hashes = list(vllm_block_hashes)[k - 1 :: k] if k > 1 else list(vllm_block_hashes)
    ids = hashing.BlockHasher(fingerprint).hash_engine(hashes)
    return hashing.tag(ids, rank, group)


@dataclass(frozen=True)
class HeldPrefix:
    """The daemon's answer: ``blocks`` leading blocks held, ``tokens`` = blocks x block
    size, and each held block's locations (``{"shard", "rank", "node", "tier", "medium",
    "locality"}``)."""

    blocks: int
    tokens: int
    locations: tuple[tuple[dict[str, Any], ...], ...]


def held_prefix(
    http: str,
    ids: np.ndarray,
    block_size: int,
    prefix: str = "kv",
    shards: int = 1,
    timeout_s: float = 5.0,
) -> HeldPrefix:
    """Ask the daemon at ``http`` (``HOST:PORT`` of its HTTP endpoint) which leading blocks
    of ``ids`` its pool holds (every shard ``0 .. shards-1`` of each)."""
    arr = np.asarray(ids, np.uint8)
    if arr.ndim != 2 or arr.shape[1] != 16:
        raise ValueError(f"ids must be an (n, 16) uint8 array, got shape {arr.shape}")
    body = json.dumps({"block_ids": hashing.to_hex(arr), "prefix": prefix, "shards": shards}).encode()
    req = urllib.request.Request(
        f"http://{http}/prefix", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            out = json.load(r)
    except urllib.error.HTTPError as e:
        if e.code == 400:
            raise ValueError(f"pool daemon {http} refused the query: {json.load(e)['error']}") from None
        raise
    n = int(out["prefix_blocks"])
    return HeldPrefix(n, n * block_size, tuple(tuple(b["locations"]) for b in out["blocks"]))
