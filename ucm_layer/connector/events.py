"""KV events of the connector, through vLLM's own hooks: ``BlockStored`` for what kvfabric stored.

When the engine runs with KV events on (``kv_events_config`` with
``enable_kv_cache_events``), vLLM's scheduler publishes, after every step, the events of
its KV cache manager and those its connector hands back from ``take_events``. kvfabric's
connector adds there one ``BlockStored`` per run of consecutive blocks that its store took:
``block_hashes`` are vLLM's own block hashes of those blocks (as vLLM publishes them:
bytes, or 64-bit ints with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), so a router that
tracks vLLM's hashes matches kvfabric's blocks to the same prompts; ``parent_block_hash``,
``token_ids``, ``block_size``, ``group_idx`` (the KV cache group), the request's LoRA;
``medium`` the tier the store's success speaks for (:func:`event_tier`).

Who emits: the scheduler, from what the workers report.

* Only the scheduler has what the event must say: vLLM's block hashes and the tokens of
  each block (the request objects), and it outlives the requests' dumps (a request may
  finish long before its last block is in the store); a worker has kvfabric's ids and
  engine block numbers only.
* Only the workers know whether a dump succeeded (the store's per-block statuses arrive
  on the worker, after the forward), and with tensor parallelism each rank stores its own
  heads: a block is stored (a lookup hits it) only once *every* rank stored its part.

So the scheduler numbers every planned dump (``Transfer.seq``) and keeps, for each, the
hashes, parents and tokens of its blocks (:class:`StoredBlocks`; nothing when events are
off); each worker reports, once the store answered, which blocks of each numbered dump
it stored (:class:`DumpReport`, through ``get_kv_connector_kv_cache_events``; vLLM
gathers the ranks' reports into one object per step and hands it to the scheduler's
``update_connector_output``); the scheduler emits a block once all ranks that store
(``ranks``: the TP size, 1 with MLA) reported it stored, and forgets a dump any rank
failed. A dump a worker skipped (its KV was computed on a failed load) is reported as
not stored.

What the connector cannot know, a block leaving the store (the pool's evictions, a posix
file removed, a node that died), is published by the pool daemon (``pool/kv_events.py``).
``BlockRemoved`` and ``AllBlocksCleared`` are therefore never emitted here.

Memory and bounds: :class:`StoredBlocks` holds at most ``max_pending`` dumps waiting for
reports (the oldest are dropped past it: a missed event, never a wrong one); reports are
tiny (a sequence number, a rank, one byte per block).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

#: vLLM's medium strings (``vllm.distributed.kv_events.MEDIUM_*``), kept here so this
#: module does not import vLLM
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"


class TierKind(enum.Enum):
    """kvfabric's store tiers, as a router sees them."""

    CACHE = "cache"  # host memory of the engine's worker process
    POOL = "pool"  # the node's pool (DRAM windows shared by the node's processes)
    POSIX = "posix"  # files (a shared file system shares them between nodes)


_MEDIUM = {TierKind.CACHE: MEDIUM_CPU, TierKind.POOL: MEDIUM_CPU, TierKind.POSIX: MEDIUM_STORAGE}
_LOCALITY = {TierKind.CACHE: "LOCAL", TierKind.POOL: "LOCAL", TierKind.POSIX: None}


@dataclass(frozen=True)
class Tier:
    """The tier a ``BlockStored`` names: vLLM's ``medium`` string, its ``locality``
    (``LOCAL``: on the publisher's node; None: unspecified) and ``ownership`` (vLLM's
    field naming the offloading tier that stored it: ``kvfabric:<tier>``, the prefix the
    pool daemon's events use too)."""

    kind: TierKind
    medium: str
    locality: str | None
    ownership: str


def event_tier(store: str, write: str = "through") -> Tier:
    """The tier a dump's success speaks for in the store pipeline ``store``
    (``cache|pool``, ``posix``, ...): the lowest tier, where lookups count a block; with
    ``pipeline.write: behind`` a dump succeeds once the cache has the bytes, so the cache."""
    names = [p.strip() for p in store.split("|") if p.strip()]
    if not names:
        raise ValueError(f"empty store pipeline {store!r}")
    name = names[0] if write == "behind" and len(names) > 1 else names[-1]
    try:
        kind = TierKind(name)
    except ValueError as e:
        raise ValueError(f"unknown store tier {name!r} in {store!r}") from e
    return Tier(kind, _MEDIUM[kind], _LOCALITY[kind], f"kvfabric:{kind.value}")


@dataclass(frozen=True)
class DumpReport:
    """One worker's answer for one numbered dump: ``ok`` holds one byte per block of the
    transfer (1: this rank's store took it)."""

    seq: int
    rank: int
    ok: bytes


@dataclass(frozen=True)
class StoredRun:
    """Consecutive blocks of one request and KV cache group, all stored on every rank:
    the fields of one ``BlockStored`` but the tier (``compat.block_stored`` adds it)."""

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    group: int
    lora_id: int | None = None
    lora_name: str | None = None


@dataclass
class _Pending:
    index: np.ndarray  # the request's block index of each row
    hashes: list[bytes]  # vLLM's hash of each row's block
    parents: list[bytes | None]  # vLLM's hash of the block before each row's
    tokens: list[Sequence[int]]  # each row's tokens
    block_size: int
    group: int
    lora_id: int | None
    lora_name: str | None
    ok: np.ndarray  # AND over the ranks' reports so far
    reports: int = 0


class StoredBlocks:
    """The scheduler's side (see the module docstring). Call order: ``planned`` for each
    numbered dump when the plan is built (``next_seq`` numbers it), ``report`` with the
    workers' reports after each step, ``take`` when vLLM asks for the step's events. One
    thread (vLLM's scheduler)."""

    def __init__(self, ranks: int, max_pending: int = 65536) -> None:
        if ranks < 1:
            raise ValueError(f"ranks must be >= 1, got {ranks}")
        self.ranks, self.max_pending = ranks, max_pending
        self._pending: dict[int, _Pending] = {}
        self._ready: list[StoredRun] = []
        self._seq = 0
        self.dropped = 0  # dumps forgotten unreported (past max_pending)

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def planned(
        self,
        seq: int,
        index: np.ndarray,
        hashes: Sequence[bytes],
        parents: Sequence[bytes | None],
        tokens: Sequence[Sequence[int]],
        block_size: int,
        group: int = 0,
        lora_id: int | None = None,
        lora_name: str | None = None,
    ) -> None:
        """Dump ``seq`` stores the blocks ``index`` of a request (their hashes, parents and
        tokens, one per row, in the transfer's row order)."""
        n = int(index.size)
        if not (len(hashes) == len(parents) == len(tokens) == n):
            raise ValueError(f"dump {seq}: {n} blocks, {len(hashes)} hashes, {len(tokens)} token rows")
        self._pending[seq] = _Pending(
            np.asarray(index, np.int64),
            list(hashes),
            list(parents),
            list(tokens),
            block_size,
            group,
            lora_id,
            lora_name,
            np.ones(n, bool),
        )
        while len(self._pending) > self.max_pending:
            del self._pending[next(iter(self._pending))]
            self.dropped += 1

    def report(self, reports: Iterable[DumpReport]) -> None:
        for r in reports:
            p = self._pending.get(r.seq)
            if p is None:
                continue
            ok = np.frombuffer(r.ok, np.uint8).astype(bool)
            if ok.size != p.ok.size:
                del self._pending[r.seq]  # not this scheduler's dump: say nothing about it
                continue
            p.ok &= ok
            p.reports += 1
            if p.reports >= self.ranks:
                del self._pending[r.seq]
                self._ready.extend(_runs(p))

    def take(self) -> list[StoredRun]:
        out, self._ready = self._ready, []
        return out

    def __len__(self) -> int:
        """Dumps waiting for reports."""
        return len(self._pending)


def _runs(p: _Pending) -> list[StoredRun]:
    """The stored rows of ``p`` cut into runs of consecutive blocks."""
    out: list[StoredRun] = []
    start = None
    n = p.ok.size
    for i in range(n + 1):
        inside = i < n and bool(p.ok[i]) and (start is None or p.index[i] == p.index[i - 1] + 1)
        if start is not None and not inside:
            rows = range(start, i)
            out.append(
                StoredRun(
                    tuple(p.hashes[j] for j in rows),
                    p.parents[start],
                    tuple(int(t) for j in rows for t in p.tokens[j]),
                    p.block_size,
                    p.group,
                    p.lora_id,
                    p.lora_name,
                )
            )
            start = None
        if i < n and bool(p.ok[i]) and start is None:
            start = i
    return out
