"""The pool's KV events in vLLM's schema, and a subscriber that follows them.

vLLM publishes what its KV-cache tiers store and drop as msgpack ``KVEventBatch`` messages
(``vllm/distributed/kv_events.py``); routers (llm-d's indexer, Dynamo's KV router,
Mooncake's indexer) consume them. The pool daemon publishes its own directory the same way
(``pool/service/events.py``), so the same consumers follow it. This module is the schema
and needs no vLLM: its structs carry vLLM's struct names as tags, its field names, field
order and msgspec options (``array_like`` batches, tagged events, ``omit_defaults``), so
``msgspec.msgpack.Decoder(vllm.distributed.kv_events.KVEventBatch)`` decodes what the pool
sends, and this module's decoder decodes vLLM's (``tests/unit/test_pool_kv_events.py``:
field for field, and the same batch encodes to the same bytes). vLLM's own classes are not
used even where vLLM is installed: importing ``vllm.distributed.kv_events`` loads most of
vLLM (about 25 s on the development machine) into a daemon that needs none of it.

What the pool's events say (``event_fields``):

``block_hashes``    the pool keys themselves, as ``bytes``: every pool object is announced
                    under its exact key, so the hashes name the directory one to one. A key
                    of the pool store (``ucm_layer/store/pool.py``) is ``<prefix>/`` + the
                    block's 16 id bytes + its shard (2 bytes, big endian): ``block_key``
                    builds it, ``parse_block_key`` takes it apart. (vLLM's own events carry
                    its block hashes; kvfabric's block ids are derived from those and the
                    engine's fingerprint, ``docs/hashing.md``.)
``token_ids``       empty, ``parent_block_hash`` None, ``block_size`` 0: the pool stores
                    bytes under keys and does not know the tokens, the chain or the block
                    size behind them.
``medium``          the window's medium in vLLM's words: ``dram`` -> ``"CPU"``, ``hbm`` ->
                    ``"GPU"`` (``MEDIUM``).
``locality``        ``"LOCAL"`` when the window belongs to a rank on the publishing daemon's
                    node, ``"REMOTE"`` when on another node (vLLM's ``Locality`` values).
``ownership``       the tier: ``"kvfabric:<pool name>:rank<r>@<node>"``, the pool rank whose
                    window holds the object (rank 0 is the daemon's own window) and the node
                    it runs on (the GVA fabric's node name; ``parse_ownership``).
``group_idx``       None (the KV-cache group of a block id is its byte 13).

``BlockRemoved`` carries the same ``medium``, ``locality`` and ``ownership`` as the
``BlockStored`` of the object. ``AllBlocksCleared`` means: forget every block of this
publisher (``remove_all``, and the first message of each publisher start, below).

Wire (as vLLM's ``ZmqEventPublisher``): a PUB socket sends three frames per batch, the topic,
the batch's sequence number (8 bytes, big endian, from 0 per publisher start) and the
payload. A ROUTER replay socket answers a request ``[b"", start_seq (8 bytes big endian)]``
(a DEALER's framing; a REQ socket adds the empty frame itself) with every buffered batch
from ``start_seq`` on, as ``[b"", topic, seq, payload]``, then ``[b"", b"", END_SEQ, b""]``
(``END_SEQ``: -1, signed). :class:`Subscriber` does all of this: it notices a sequence gap
and fills it from the replay endpoint.

Memory: decoded batches belong to the caller; nothing here keeps references to them.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvfabric.platform.types import Medium

ID_BYTES = 16  # a block id (ucm_layer/hashing.py)
SHARD_BYTES = 2  # the pool store's shard suffix, big endian
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker

#: vLLM's medium strings (``MEDIUM_GPU``, ``MEDIUM_CPU``, ``MEDIUM_STORAGE``)
MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE = "GPU", "CPU", "STORAGE"
#: a pool window's medium -> vLLM's medium string
MEDIUM: dict[Medium, str] = {Medium.DRAM: MEDIUM_CPU, Medium.HBM: MEDIUM_GPU}


class Locality(enum.Enum):
    """Where a block is relative to the publisher (vLLM's ``Locality`` values)."""

    LOCAL = "LOCAL"
    REMOTE = "REMOTE"


# --------------------------------------------------------------------- the schema
# Names, field order and options follow vllm/distributed/kv_events.py; a field added
# there with a default decodes here as absent, one added here would break vLLM's decoder.


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    """A batch on the wire: ``[ts, events, data_parallel_rank]`` (the last omitted when None)."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """An event: a map tagged ``"type": "<struct name>"``."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


Event = BlockStored | BlockRemoved | AllBlocksCleared

_DECODER = msgspec.msgpack.Decoder(KVEventBatch)
_ENCODER = msgspec.msgpack.Encoder()


def encode_batch(batch: KVEventBatch) -> bytes:
    """The payload frame of one batch."""
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A payload frame (this pool's or a vLLM engine's) as a batch; ``msgspec.DecodeError``
    for anything else."""
    return _DECODER.decode(payload)


def stored(hashes: list[bytes], medium: str, locality: str, ownership: str) -> BlockStored:
    """``BlockStored`` of pool objects (see the module docstring for the fields)."""
    return BlockStored(
        block_hashes=hashes,  # type: ignore[arg-type]
        parent_block_hash=None,
        token_ids=[],
        block_size=0,
        lora_id=None,
        medium=medium,
        lora_name=None,
        locality=locality,
        ownership=ownership,
    )


def removed(hashes: list[bytes], medium: str, locality: str, ownership: str) -> BlockRemoved:
    return BlockRemoved(block_hashes=hashes, medium=medium, locality=locality, ownership=ownership)  # type: ignore[arg-type]


def ownership(pool: str, rank: int, node: str | None = None) -> str:
    """The tier name of a pool rank's window: ``kvfabric:<pool>:rank<r>@<node>`` (without
    ``@<node>`` when the node is not known)."""
    return f"kvfabric:{pool}:rank{rank}" + (f"@{node}" if node else "")


def parse_ownership(value: str) -> tuple[str, int, str | None] | None:
    """``(pool, rank, node)`` of an ``ownership`` this pool wrote, None for any other."""
    head, _, rest = value.partition(":")
    pool, _, where = rest.rpartition(":")
    rank, _, node = where.partition("@")
    if head != "kvfabric" or not pool or not rank.startswith("rank") or not rank[4:].isdigit():
        return None
    return pool, int(rank[4:]), node or None


# --------------------------------------------------------------------- block keys
def block_key(prefix: str, block_id: bytes, shard: int = 0) -> bytes:
    """The pool store's key of one shard of a block: ``<prefix>/`` + 16 id bytes + shard."""
    if not isinstance(block_id, bytes) or len(block_id) != ID_BYTES:
        raise ValueError(f"a block id is {ID_BYTES} bytes, got {block_id!r:.60}")
    if not prefix or "/" in prefix:
        raise ValueError(f"prefix must be non-empty without '/', got {prefix!r}")
    if isinstance(shard, bool) or not isinstance(shard, int) or not 0 <= shard < 1 << 16:
        raise ValueError(f"shard must be an int in [0, 65536), got {shard!r}")
    return f"{prefix}/".encode() + block_id + shard.to_bytes(SHARD_BYTES, "big")


def parse_block_key(key: bytes) -> tuple[str, bytes, int] | None:
    """``(prefix, block id, shard)`` of a pool store key, or None for any other key (one
    whose byte before its last 18 is not ``/``, or whose prefix is empty, holds ``/`` or is
    not UTF-8)."""
    tail = ID_BYTES + SHARD_BYTES
    if len(key) < tail + 2 or key[-tail - 1] != 0x2F:
        return None
    try:
        prefix = key[: -tail - 1].decode("utf-8")
    except UnicodeDecodeError:
        return None
    if "/" in prefix:
        return None
    return prefix, key[-tail:-SHARD_BYTES], int.from_bytes(key[-SHARD_BYTES:], "big")


# --------------------------------------------------------------------- following a publisher
@dataclass
class BlockSet:
    """The blocks a stream of events says are stored: ``hash -> (medium, ownership)``.
    ``apply`` takes batches in sequence order; the caller owns the object."""

    blocks: dict[bytes | int, tuple[str | None, str | None]] = field(default_factory=dict)
    cleared: int = 0  # AllBlocksCleared seen

    def apply(self, batch: Any) -> None:
        """One decoded batch (this module's ``KVEventBatch`` or vLLM's: by struct name)."""
        for ev in batch.events:
            kind = type(ev).__name__
            if kind == "BlockStored":
                for h in ev.block_hashes:
                    self.blocks[h] = (ev.medium, ev.ownership)
            elif kind == "BlockRemoved":
                for h in ev.block_hashes:
                    self.blocks.pop(h, None)
            elif kind == "AllBlocksCleared":
                self.blocks.clear()
                self.cleared += 1

    def keys(self) -> set[bytes | int]:
        return set(self.blocks)


class Subscriber:
    """A SUB socket on a publisher (the pool daemon's or a vLLM engine's), with repair.

    ``poll(timeout_s)`` receives what has arrived and returns the batches to apply, in
    sequence order, as ``(seq, batch)``. It resyncs from the replay endpoint (everything it
    buffers, from sequence 0 on) whenever the stream cannot be trusted as it is:

    * a gap: a batch past the next expected number (a subscriber that joined late, messages
      ZMQ dropped for a slow subscriber);
    * a (re)connection (a ZMQ handshake: the first connection, or the publisher back after
      a restart or a network cut), so a subscriber catches up without waiting for traffic;
    * a live number not above the last live one: live numbers only grow within one
      publisher start.

    A publisher start is told apart by batch 0 (its snapshot, which begins with
    ``AllBlocksCleared``): when the replay's batch 0 is not the one this subscriber knows
    (its ``ts``), the publisher restarted, and the subscriber applies the new stream from 0
    (``restarts``); otherwise it applies what it lacks. ``gaps`` counts resyncs for gaps,
    ``missing`` the numbers neither the stream nor the replay had (the buffer had moved on:
    lost for good; rebuild from the directory, ``/keys``). Left open: a publisher whose
    buffer no longer holds batch 0 and that restarts while this subscriber is connected
    and hears none of the new stream's first batches is taken for the old one.

    ``decoder``: how a payload becomes a batch (this module's :func:`decode_batch` by
    default; a test passes vLLM's). ``drop``: a test hook, called with each live sequence
    number; True discards that message as if the network had. One thread uses a
    subscriber; ``close()`` closes its sockets."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        decoder: Any = None,
        drop: Any = None,
    ) -> None:
        import zmq

        self._zmq = zmq
        self.ctx = zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._monitor = self.sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.decode = decoder or decode_batch
        self.drop = drop
        self.next_seq = 0
        self.gaps = 0
        self.missing = 0
        self.received = 0
        self.restarts = 0
        self.connects = 0
        self._last_live = -1
        self._epoch: float | None = None  # ts of batch 0 of the publisher followed

    def poll(self, timeout_s: float = 0.0) -> list[tuple[int, Any]]:
        zmq = self._zmq
        out: list[tuple[int, Any]] = []
        poller = zmq.Poller()
        poller.register(self.sub, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        wait_ms = int(timeout_s * 1000)
        while True:
            ready = dict(poller.poll(wait_ms))
            if not ready:
                return out
            wait_ms = 0
            if self._monitor in ready:
                while self._monitor.poll(0, zmq.POLLIN):
                    self._monitor.recv_multipart()
                    self.connects += 1
                out.extend(self._resync())
            if self.sub in ready:
                out.extend(self._live())

    def _live(self) -> list[tuple[int, Any]]:
        """Every message waiting on the SUB socket."""
        zmq = self._zmq
        out: list[tuple[int, Any]] = []
        while self.sub.poll(0, zmq.POLLIN):
            _topic, seq_b, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_b, "big")
            if self.drop is not None and self.drop(seq):
                continue
            self.received += 1
            restarted = seq <= self._last_live
            self._last_live = seq
            if seq != self.next_seq and (seq > self.next_seq or restarted):
                if not restarted:
                    self.gaps += 1
                out.extend(self._resync())
            if seq < self.next_seq:
                continue  # had it (from the replay)
            if seq > self.next_seq:
                self.missing += seq - self.next_seq
            out.append(self._take(seq, payload))
        return out

    def _take(self, seq: int, payload: bytes) -> tuple[int, Any]:
        batch = self.decode(payload)
        if seq == 0:
            self._epoch = batch.ts
        self.next_seq = seq + 1
        return seq, batch

    def _resync(self) -> list[tuple[int, Any]]:
        """What the replay endpoint has that this subscriber lacks (see the class docstring)."""
        frames = self._replay()
        if frames and frames[0][0] == 0:
            first = self.decode(frames[0][1])
            if self.next_seq > 0 and first.ts != self._epoch:
                self.restarts += 1  # a new publisher: its stream from 0
                self.next_seq = 0
        out = []
        for seq, payload in frames:
            if seq < self.next_seq:
                continue
            if seq > self.next_seq:
                self.missing += seq - self.next_seq  # the buffer no longer has those
            out.append(self._take(seq, payload))
        return out

    def _replay(self) -> list[tuple[int, bytes]]:
        """Every batch the replay endpoint buffers, as ``(seq, payload)`` (none without one)."""
        if self.replay_endpoint is None:
            return []
        zmq = self._zmq
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        out: list[tuple[int, bytes]] = []
        try:
            sock.connect(self.replay_endpoint)
            sock.send_multipart([b"", (0).to_bytes(8, "big")])
            while True:
                if not sock.poll(5000, zmq.POLLIN):
                    raise TimeoutError(f"replay endpoint {self.replay_endpoint} did not answer in 5 s")
                _empty, _topic, seq_b, payload = sock.recv_multipart()
                if seq_b == END_SEQ:
                    return out
                out.append((int.from_bytes(seq_b, "big"), payload))
        finally:
            sock.close()

    def follow(self, blocks: BlockSet, timeout_s: float = 0.0) -> int:
        """``poll`` and apply what arrived to ``blocks``; the number of batches applied."""
        got = self.poll(timeout_s)
        for _, batch in got:
            blocks.apply(batch)
        return len(got)

    def resync(self, blocks: BlockSet) -> int:
        """Ask the replay endpoint now for what this subscriber lacks and apply it to
        ``blocks``; the number of batches applied. A lost message is noticed only when a
        later one arrives: a caller that hears nothing for a while calls this."""
        got = self._resync()
        for _, batch in got:
            blocks.apply(batch)
        return len(got)

    def catch_up(self, until_seq: int, blocks: BlockSet, timeout_s: float = 10.0) -> None:
        """Follow until batch ``until_seq`` has been applied (``TimeoutError`` after
        ``timeout_s``); when nothing arrives, resync from the replay endpoint."""
        deadline = time.monotonic() + timeout_s
        while self.next_seq <= until_seq:
            if not self.follow(blocks, 0.05):
                self.resync(blocks)
            if time.monotonic() > deadline:
                raise TimeoutError(f"batch {until_seq} not seen in {timeout_s} s (next {self.next_seq})")

    def close(self) -> None:
        self.sub.disable_monitor()
        self._monitor.close(linger=0)
        self.sub.close(linger=0)
