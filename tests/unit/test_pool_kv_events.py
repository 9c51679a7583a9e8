"""The pool's KV events: vLLM's schema both ways, block keys, the service's hooks, config."""

from __future__ import annotations

import time

import msgspec
import pytest
import vllm_kv_events

from kvfabric.platform.types import Medium
from kvfabric.pool import kv_events as ke
from kvfabric.pool import table as tbl
from kvfabric.pool.config import PoolConfig
from kvfabric.pool.service.events import CLEARED, REMOVED, STORED, EventQueue
from kvfabric.pool.service.meta import MetaService
from kvfabric.pool.service.prefix import BadQuery, parse
from kvfabric.pool.status import Status
from kvfabric.pool.windows import FixedStride

KiB = 1024
VLLM = vllm_kv_events.load()
needs_vllm = pytest.mark.skipif(VLLM is None, reason="vLLM is not installed (its schema is the reference)")


def _batch() -> ke.KVEventBatch:
    key = ke.block_key("kv", bytes(range(16)), 3)
    return ke.KVEventBatch(
        ts=1234.5,
        events=[
            ke.AllBlocksCleared(),
            ke.stored([key, b"greeting"], ke.MEDIUM_CPU, ke.Locality.LOCAL.value, ke.ownership("p", 0)),
            ke.removed([key], ke.MEDIUM_GPU, ke.Locality.REMOTE.value, ke.ownership("p", 2)),
        ],
    )


@needs_vllm
def test_vllms_decoder_reads_the_pools_batches() -> None:
    got = msgspec.msgpack.Decoder(VLLM.KVEventBatch).decode(ke.encode_batch(_batch()))
    assert isinstance(got, VLLM.KVEventBatch) and got.ts == 1234.5
    cleared, stored, removed = got.events
    assert isinstance(cleared, VLLM.AllBlocksCleared)
    assert isinstance(stored, VLLM.BlockStored) and isinstance(removed, VLLM.BlockRemoved)
    assert stored.block_hashes == [b"kv/" + bytes(range(16)) + b"\x00\x03", b"greeting"]
    assert (stored.token_ids, stored.parent_block_hash, stored.block_size) == ([], None, 0)
    assert (stored.medium, stored.locality, stored.ownership) == (
        VLLM.MEDIUM_CPU,
        "LOCAL",
        "kvfabric:p:rank0",
    )
    assert (removed.medium, removed.locality, removed.ownership) == (
        VLLM.MEDIUM_GPU,
        "REMOTE",
        "kvfabric:p:rank2",
    )
    assert got.data_parallel_rank is None


@needs_vllm
def test_the_same_batch_encodes_to_the_same_bytes_and_vllms_decode_here() -> None:
    h = ke.block_key("kv", b"\x01" * 16)
    theirs = VLLM.KVEventBatch(
        ts=2.0,
        events=[
            VLLM.BlockStored(
                block_hashes=[h],
                parent_block_hash=None,
                token_ids=[],
                block_size=0,
                lora_id=None,
                medium=VLLM.MEDIUM_CPU,
                lora_name=None,
                locality="LOCAL",
                ownership="kvfabric:p:rank0",
            ),
            VLLM.BlockRemoved(
                block_hashes=[h], medium=VLLM.MEDIUM_CPU, locality="LOCAL", ownership="kvfabric:p:rank0"
            ),
            VLLM.AllBlocksCleared(),
        ],
    )
    ours = ke.KVEventBatch(
        ts=2.0,
        events=[
            ke.stored([h], ke.MEDIUM_CPU, "LOCAL", "kvfabric:p:rank0"),
            ke.removed([h], ke.MEDIUM_CPU, "LOCAL", "kvfabric:p:rank0"),
            ke.AllBlocksCleared(),
        ],
    )
    enc = msgspec.msgpack.Encoder()
    assert enc.encode(theirs) == ke.encode_batch(ours)
    # what a vLLM engine sends (token ids, chained hashes, int hashes, a DP rank) decodes here
    engine = VLLM.KVEventBatch(
        ts=3.0,
        events=[
            VLLM.BlockStored(
                block_hashes=[7, 8],
                parent_block_hash=6,
                token_ids=list(range(32)),
                block_size=16,
                lora_id=None,
                medium=VLLM.MEDIUM_GPU,
                lora_name=None,
                extra_keys=[None, ("salt",)],
                group_idx=1,
                session_id="s",
            )
        ],
        data_parallel_rank=2,
    )
    got = ke.decode_batch(enc.encode(engine))
    (ev,) = got.events
    assert (ev.block_hashes, ev.parent_block_hash, ev.token_ids[:3], ev.block_size) == (
        [7, 8],
        6,
        [0, 1, 2],
        16,
    )
    assert (ev.group_idx, ev.session_id, got.data_parallel_rank) == (1, "s", 2)


@needs_vllm
def test_the_schema_is_vllms_field_for_field() -> None:
    for name in (
        "EventBatch",
        "KVCacheEvent",
        "BlockStored",
        "BlockRemoved",
        "AllBlocksCleared",
        "KVEventBatch",
    ):
        mine, theirs = getattr(ke, name), getattr(VLLM, name)
        assert mine.__struct_fields__ == theirs.__struct_fields__, name
        cm, ct = mine.__struct_config__, theirs.__struct_config__
        assert (cm.array_like, cm.omit_defaults, cm.tag, cm.tag_field) == (
            ct.array_like,
            ct.omit_defaults,
            ct.tag,
            ct.tag_field,
        ), name
        assert mine.__struct_defaults__ == theirs.__struct_defaults__, name
    assert (ke.MEDIUM_GPU, ke.MEDIUM_CPU, ke.MEDIUM_STORAGE) == (
        VLLM.MEDIUM_GPU,
        VLLM.MEDIUM_CPU,
        VLLM.MEDIUM_STORAGE,
    )
    assert ke.END_SEQ == VLLM.END_SEQ


def test_block_keys_round_trip_and_other_keys_are_not_blocks() -> None:
    bid = bytes(range(100, 116))
    key = ke.block_key("model-a", bid, 513)
    assert key == b"model-a/" + bid + b"\x02\x01"
    assert ke.parse_block_key(key) == ("model-a", bid, 513)
    for other in (
        b"greeting",
        b"kv/short",
        b"a/b/" + bid + b"\x00\x00",
        b"/" + bid + b"\x00\x00",
        b"\xff/" + bid + b"ab",
    ):
        assert ke.parse_block_key(other) is None, other
    with pytest.raises(ValueError, match="16 bytes"):
        ke.block_key("kv", b"short")
    with pytest.raises(ValueError, match="shard"):
        ke.block_key("kv", bid, 1 << 16)
    with pytest.raises(ValueError, match="prefix"):
        ke.block_key("a/b", bid)


def test_block_set_follows_stores_removals_and_clears() -> None:
    blocks = ke.BlockSet()
    blocks.apply(ke.KVEventBatch(ts=0, events=[ke.stored([b"a", b"b"], "CPU", "LOCAL", "t")]))
    blocks.apply(ke.KVEventBatch(ts=0, events=[ke.removed([b"a", b"never"], "CPU", "LOCAL", "t")]))
    assert blocks.keys() == {b"b"} and blocks.blocks[b"b"] == ("CPU", "t")
    blocks.apply(
        ke.KVEventBatch(ts=0, events=[ke.AllBlocksCleared(), ke.stored([b"c"], "GPU", "LOCAL", "t")])
    )
    assert blocks.keys() == {b"c"} and blocks.cleared == 1


# --------------------------------------------------------------------- the service's hooks
@pytest.fixture
def svc():
    view = tbl.create(64)
    cfg = PoolConfig(dram=0, max_objects=64, write_lease_s=5)
    s = MetaService(cfg, view, FixedStride())
    s.add_window(0, Medium.DRAM, 64 * KiB)
    s.add_window(1, Medium.DRAM, 64 * KiB)
    s.events = EventQueue(limit=1000)
    yield s
    view.close()
    view.seg.unlink()


def _drain(q: EventQueue) -> list[tuple[int, list[bytes]]]:
    return [(kind, keys) for kind, keys, _ in q.take()]


def _put(
    s: MetaService, keys: list[bytes], size: int = 8 * KiB, rank: int | None = None, **kw: float
) -> list[int]:
    st, gvas, _ = s.alloc("c", keys, [size] * len(keys), preferred_rank=rank)
    assert st == [Status.OK] * len(keys)
    assert s.commit("c", keys, [True] * len(keys), **kw) == [Status.OK] * len(keys)
    return gvas


def test_the_service_reports_readable_objects_and_their_departures(svc: MetaService) -> None:
    q = svc.events
    assert q is not None
    gvas = _put(svc, [b"a", b"b"], rank=0)
    assert q.take() == [(STORED, [b"a", b"b"], gvas)]
    svc.alloc("c", [b"abandoned"], [KiB])
    svc.commit("c", [b"abandoned"], [False])  # never readable: never announced
    assert _drain(q) == []
    svc.remove([b"a", b"missing"])
    assert _drain(q) == [(REMOVED, [b"a"])]
    _put(svc, [b"ttl"], rank=0, ttl_s=0.1)
    time.sleep(0.25)
    svc.tick()
    assert _drain(q) == [(STORED, [b"ttl"]), (REMOVED, [b"ttl"])]
    _put(svc, [b"on1"], rank=1)
    svc.drop_rank(1)  # a rank that leaves takes its blocks along
    assert _drain(q) == [(STORED, [b"on1"]), (REMOVED, [b"on1"])]
    svc.remove_all()
    assert _drain(q) == [(CLEARED, [])]  # one clear, not a removal per object


def test_eviction_is_reported_per_object(svc: MetaService) -> None:
    q = svc.events
    assert q is not None
    for i in range(12):  # 12 x 8 KiB into two 64 KiB windows: the watermarks evict
        _put(svc, [b"k%d" % i], rank=0)
    kinds = [k for k, _ in _drain(q)]
    assert kinds.count(STORED) == 12 and kinds.count(REMOVED) == svc.counters.evicted_objects > 0


def test_a_full_queue_drops_and_asks_for_a_snapshot() -> None:
    q = EventQueue(limit=3)
    q.stored([b"a", b"b"], [1, 2])
    q.stored([b"c", b"d"], [3, 4])  # past the limit: dropped, and so is all that follows
    q.removed([b"a"], [1])
    assert q.lost and q.dropped == 3 and len(q.take()) == 1
    q.restart([(STORED, [b"x", b"y", b"z", b"w"], [9, 8, 7, 6])])  # a snapshot replaces what waited
    q.removed([b"a"], [1])  # the snapshot does not count toward the limit
    assert not q.lost and q.take() == [
        (STORED, [b"x", b"y", b"z", b"w"], [9, 8, 7, 6]),
        (REMOVED, [b"a"], [1]),
    ]


# --------------------------------------------------------------------- config, /prefix input
@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"kv_events_endpoint": "zmq:5557"}, "kv_events_endpoint='zmq:5557': expected tcp://"),
        ({"kv_events_endpoint": "tcp://host"}, "kv_events_endpoint='tcp://host': expected HOST:PORT"),
        ({"kv_events_replay_endpoint": "tcp://*:5558"}, "needs kv_events_endpoint"),
        ({"kv_events_endpoint": "tcp://*:5557", "kv_events_replay_endpoint": "tcp://*:5557"}, "of its own"),
        ({"kv_events_buffer": 0}, "kv_events_buffer=0"),
        ({"kv_events_queue": "many"}, "kv_events_queue='many'"),
    ],
)
def test_kv_events_config_is_checked(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PoolConfig.from_mapping(kw)


def test_kv_events_config_defaults_off() -> None:
    cfg = PoolConfig.from_flags(["kv_events_endpoint=tcp://*:0", "kv_events_replay_endpoint=ipc:///tmp/r"])
    assert (cfg.kv_events_endpoint, cfg.kv_events_buffer, cfg.kv_events_topic) == ("tcp://*:0", 4096, "")
    assert PoolConfig().kv_events_endpoint == ""


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b"{", "not JSON"),
        (b"[]", "a JSON object"),
        (b'{"block_ids": [], "block_hashes": []}', "exactly one"),
        (b'{"blocks": []}', "unknown field"),
        (b'{"block_ids": ["00"]}', r"block_ids\[0\]: expected 32 hex digits"),
        (b'{"block_ids": ["' + b"0" * 32 + b'", 5]}', r"block_ids\[1\]"),
        (b'{"block_ids": [], "shards": 0}', "shards: expected an integer"),
        (b'{"block_ids": [], "prefix": "a/b"}', "prefix: expected"),
        (b'{"block_hashes": ["zz"]}', r"block_hashes\[0\]: expected the hex of a pool key"),
        (b'{"block_hashes": [], "shards": 2}', "shards goes with block_ids"),
    ],
)
def test_prefix_queries_name_the_bad_field(body: bytes, match: str) -> None:
    with pytest.raises(BadQuery, match=match):
        parse(body)


def test_prefix_query_keys_are_the_pool_stores() -> None:
    bid = bytes(range(16))
    names, shards, keys = parse(b'{"block_ids": ["' + bid.hex().encode() + b'"], "prefix": "m", "shards": 2}')
    assert (names, shards) == ([bid], 2)
    assert keys == [ke.block_key("m", bid, 0), ke.block_key("m", bid, 1)]


def test_router_ids_take_the_last_engine_hash_of_each_block() -> None:
    from kvfabric.ucm_layer import hashing, routing

    fp = hashing.Fingerprint("m", "bfloat16", "2x4x1KiB", block_size=32)
    hashes = [bytes([i]) * 32 for i in range(6)]  # vLLM hashes blocks of 16 tokens, kvfabric of 32
    two = routing.pool_block_ids(fp, hashes, hashes_per_block=2, rank=1)
    assert (two == hashing.tag(hashing.BlockHasher(fp).hash_engine(hashes[1::2]), 1, 0)).all()
    assert two.shape == (3, 16) and (hashing.rank_of(two) == 1).all()
    with pytest.raises(ValueError, match="hashes_per_block"):
        routing.pool_block_ids(fp, hashes, hashes_per_block=0)


def test_ownership_names_pool_rank_and_node() -> None:
    assert ke.ownership("p", 3, "host-a/1f") == "kvfabric:p:rank3@host-a/1f"
    assert ke.parse_ownership("kvfabric:p:rank3@host-a/1f") == ("p", 3, "host-a/1f")
    assert ke.parse_ownership(ke.ownership("p", 0)) == ("p", 0, None)
    for other in ("kvcr", "kvfabric:p:3", "lmcache:p:rank1", "kvfabric::rank1"):
        assert ke.parse_ownership(other) is None, other
