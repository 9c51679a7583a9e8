"""``POST /prefix``: how long a prefix of blocks the pool holds, and where, for routers.

A router that has a request's block ids (kvfabric's 16-byte ids, what the vLLM connector
stores under: ``ucm_layer/routing.py`` computes them from vLLM's block hashes and the
engine's fingerprint, and asks this endpoint) or the block hashes of this pool's KV events
(``pool/kv_events.py``: the pool keys) asks which leading run of them the pool holds. JSON in, one of:

``{"block_ids": ["<32 hex digits>", ...], "prefix": "kv", "shards": 1}``
    blocks of the pool store: block ``i`` is held when every shard ``0 .. shards-1`` of it
    is (``<prefix>/`` + id + shard, the pool store's keys; ``prefix`` defaults to ``kv``,
    the store's default, ``shards`` to 1: whole-block dumps; layer-wise dumps have one
    shard per layer);
``{"block_hashes": ["<hex>", ...]}``
    the hashes exactly as the KV events carry them (each the hex of a pool key).

JSON out (200): ``{"queried": n, "prefix_blocks": k, "blocks": [...]}``: ``k`` is the
number of leading blocks held (the first block that is not held ends the prefix, whatever
follows it), and ``blocks`` has one entry per held block of the prefix, ``{"block": hex,
"locations": [{"shard", "rank", "node", "tier", "medium", "locality"}, ...]}`` (``tier``:
the window's medium, ``dram`` / ``hbm``; ``medium``: vLLM's word for it, ``CPU`` /
``GPU``; ``locality``: ``LOCAL`` on this daemon's node, else ``REMOTE``; ``shard`` is
null for ``block_hashes``). A bad request is 400 with ``{"error": ...}`` naming the field
and the first bad index (``block_ids[2]: expected 32 hex digits ...``).

Fast and off the service: the keys are looked up in the shared directory table with the
lock-free reader every on-node client uses (``TableView.lookup_many``: seqlocked slots, in
C), so a query never takes the dispatcher's lock and never stalls a metadata RPC; it sees
each object before or after any concurrent change, never half of one. Only READABLE,
unexpired objects count, as for ``get``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np

from kvfabric.platform.types import Medium
from kvfabric.pool import kv_events as ke
from kvfabric.pool.keys import MAX_BATCH, MAX_KEY_BYTES
from kvfabric.pool.table import SlotState, TableView, ticks_passed

MAX_BLOCKS = 65_536  # blocks in one query (a 1M-token prompt at block size 16)
_FIELDS = {"block_ids", "block_hashes", "prefix", "shards"}


class BadQuery(ValueError):
    """A request the endpoint refuses (400); the message names the field."""


def _hex_list(body: dict[str, Any], name: str, nbytes: int | None) -> list[bytes]:
    values = body[name]
    if not isinstance(values, list):
        raise BadQuery(f"{name}: expected a list of hex strings, got {type(values).__name__}")
    if len(values) > MAX_BLOCKS:
        raise BadQuery(f"{name} holds {len(values)} items; one query takes at most {MAX_BLOCKS}")
    out = []
    for i, v in enumerate(values):
        try:
            raw = bytes.fromhex(v) if isinstance(v, str) else None
        except ValueError:
            raw = None
        if nbytes is not None and (raw is None or len(raw) != nbytes):
            raise BadQuery(
                f"{name}[{i}]: expected {2 * nbytes} hex digits (a {nbytes}-byte block id), got {v!r:.80}"
            )
        if raw is None or not 1 <= len(raw) <= MAX_KEY_BYTES:
            raise BadQuery(
                f"{name}[{i}]: expected the hex of a pool key (1 to {MAX_KEY_BYTES} bytes), got {v!r:.80}"
            )
        out.append(raw)
    return out


def parse(body: bytes) -> tuple[list[bytes], int, list[bytes]]:
    """``(block names, shards, keys)`` of a request body; keys are block-major (block ``i``'s
    shard ``s`` at ``i * shards + s``). ``BadQuery`` naming the field."""
    try:
        req = json.loads(body or b"null")
    except (ValueError, UnicodeDecodeError) as e:
        raise BadQuery(f"the body is not JSON: {e}") from None
    if not isinstance(req, dict):
        raise BadQuery('expected a JSON object: {"block_ids": [...]} or {"block_hashes": [...]}')
    unknown = sorted(set(req) - _FIELDS)
    if unknown:
        raise BadQuery(f"unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(_FIELDS))}")
    if ("block_ids" in req) == ("block_hashes" in req):
        raise BadQuery("give exactly one of block_ids (with prefix, shards) and block_hashes")
    if "block_hashes" in req:
        for k in ("prefix", "shards"):
            if k in req:
                raise BadQuery(f"{k} goes with block_ids; block_hashes are whole pool keys")
        hashes = _hex_list(req, "block_hashes", None)
        return hashes, 1, hashes
    prefix, shards = req.get("prefix", "kv"), req.get("shards", 1)
    if not isinstance(prefix, str) or not prefix or "/" in prefix:
        raise BadQuery(f"prefix: expected a non-empty string without '/', got {prefix!r:.80}")
    if isinstance(shards, bool) or not isinstance(shards, int) or not 1 <= shards <= 1 << 16:
        raise BadQuery(f"shards: expected an integer in [1, 65536], got {shards!r:.80}")
    ids = _hex_list(req, "block_ids", ke.ID_BYTES)
    if len(ids) * shards > MAX_BATCH:
        raise BadQuery(f"{len(ids)} block_ids x {shards} shards: at most {MAX_BATCH} keys a query")
    head = f"{prefix}/".encode()
    keys = [head + i + s.to_bytes(ke.SHARD_BYTES, "big") for i in ids for s in range(shards)]
    return ids, shards, keys


class PrefixQuery:
    """Answers ``/prefix`` (see module docstring) from the directory table ``view``.

    ``decode(gva) -> (medium, rank, offset)``: the pool's addressing; ``node_of(rank)``: the
    node a rank runs on (None if unknown); ``node``: this daemon's node. Thread-safe: each
    call reads the table lock-free and keeps nothing."""

    def __init__(
        self,
        view: TableView,
        decode: Callable[[int], tuple[Medium, int, int]],
        node_of: Callable[[int], str | None],
        node: str,
    ) -> None:
        self.view, self.decode, self.node_of, self.node = view, decode, node_of, node

    def answer(self, body: bytes) -> tuple[int, dict[str, Any]]:
        """``(HTTP status, JSON object)`` for one request body."""
        try:
            names, shards, keys = parse(body)
        except BadQuery as e:
            return 400, {"error": str(e)}
        if not keys:
            return 200, {"queried": 0, "prefix_blocks": 0, "blocks": []}
        idx, out = self.view.lookup_many(keys)
        held = (idx >= 0) & (out[:, 4] == int(SlotState.READABLE))
        for k in np.flatnonzero(held & (out[:, 5] != 0)).tolist():
            if ticks_passed(int(out[k, 5])):
                held[k] = False
        whole = held.reshape(len(names), shards).all(axis=1)
        n = len(names) if whole.all() else int(np.argmin(whole))
        blocks = []
        by_id = keys is not names  # block_ids: keys per shard; block_hashes: the keys themselves
        for b in range(n):
            locs = []
            for s in range(shards):
                medium, rank, _ = self.decode(int(out[b * shards + s, 1]))
                node = self.node_of(rank)
                locs.append(
                    {
                        "shard": s if by_id else None,
                        "rank": rank,
                        "node": node,
                        "tier": medium.value,
                        "medium": ke.MEDIUM.get(medium, ke.MEDIUM_CPU),
                        "locality": (ke.Locality.LOCAL if node == self.node else ke.Locality.REMOTE).value,
                    }
                )
            blocks.append({"block": names[b].hex(), "locations": locs})
        return 200, {"queried": len(names), "prefix_blocks": n, "blocks": blocks}
