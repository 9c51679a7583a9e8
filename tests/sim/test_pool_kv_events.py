"""The pool daemon's KV events and ``POST /prefix``, against a real daemon subprocess.

ZMQ subscribers on 127.0.0.1 decode with vLLM's own schema classes (``vllm_kv_events``:
vLLM's source, without importing the vLLM package; this module's decoder when vLLM is
absent) while real pool clients put (into a window small enough that LRU eviction runs),
remove, lose a rank with its window (a client process killed) and clear the pool; the
blocks the events describe must equal the daemon's directory (``/keys``). Subscribers
that joined late or dropped messages find the gap by sequence number and fill it from the
replay endpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import msgspec
import numpy as np
import pytest
import vllm_kv_events
from kvf_testing import segments
from pool_testing import Daemon

from kvfabric.harness.procs import free_port
from kvfabric.platform import shm
from kvfabric.pool import EmbeddedPool, connect
from kvfabric.pool import kv_events as ke
from kvfabric.pool.config import PoolConfig
from kvfabric.pool.keys import KeyBatch, key_from_text
from kvfabric.ucm_layer import routing
from kvfabric.ucm_layer.hashing import Fingerprint

KiB, MiB = 1 << 10, 1 << 20
VLLM = vllm_kv_events.load()
DECODE = msgspec.msgpack.Decoder(VLLM.KVEventBatch).decode if VLLM is not None else ke.decode_batch


@pytest.fixture
def daemon(tmp_path, isolated_shm):
    extra = {
        "kv_events_endpoint": "tcp://127.0.0.1:0",
        "kv_events_replay_endpoint": "tcp://127.0.0.1:0",
        "max_objects": 4096,
    }
    d = Daemon(tmp_path, name="ev", dram="4MiB", extra=extra).start()
    yield d
    assert d.stop() == 0
    shm.sweep()  # the window of the client process a test killed
    assert segments(isolated_shm) == []


def _http(d: Daemon, path: str, body: bytes | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{d.ready['http_port']}{path}", data=body)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def _directory(d: Daemon) -> set[bytes]:
    keys: list[str] = []
    start: int | None = 0
    while start is not None:
        code, page = _http(d, f"/keys?start={start}&limit=10000")
        assert code == 200
        keys += page["keys"]
        start = page["next"]
    return {key_from_text(k) for k in keys}


def _converge(d: Daemon, subs: list[tuple[ke.Subscriber, ke.BlockSet]], timeout: float = 15.0) -> set[bytes]:
    """The directory, once every subscriber's blocks equal it (the publisher sends what the
    service reported within 5 ms; with no call in flight the directory stays put). A
    subscriber that heard nothing new resyncs: a lost last message has no successor to
    reveal the gap."""
    deadline = time.monotonic() + timeout
    while True:
        want = _directory(d)
        for sub, blocks in subs:
            if not sub.follow(blocks, 0.02) and blocks.keys() != want:
                sub.resync(blocks)
        if all(blocks.keys() == want for _, blocks in subs):
            return want
        assert time.monotonic() < deadline, [len(blocks.keys() ^ want) for _, blocks in subs]


def _ids(first: int, n: int) -> np.ndarray:
    return np.arange(first, first + n, dtype=np.uint64).view(np.uint8).reshape(n, 8).repeat(2, axis=1)


RANK_CHILD = """
import sys, time
from kvfabric.harness.procs import free_port
from kvfabric.platform import shm
from kvfabric.pool import EmbeddedPool, connect
c = connect(sys.argv[1], window_bytes=1 << 20)
for i in range(6):
    c.put(f"child/{i}", bytes(16 << 10))
print("ready", c.rank, flush=True)
time.sleep(120)
"""


def test_events_rebuild_the_directory_through_evictions_removals_a_lost_rank_and_a_clear(daemon):
    d = daemon
    pub, replay = d.ready["kv_events_endpoint"], d.ready["kv_events_replay_endpoint"]
    assert pub.startswith("tcp://127.0.0.1:") and replay.startswith("tcp://127.0.0.1:")
    early = ke.Subscriber(pub, replay, decoder=DECODE)  # misses the start-up snapshot, then repairs
    lossy = ke.Subscriber(pub, replay, decoder=DECODE, drop=lambda seq: seq % 3 == 1)
    subs = [(early, ke.BlockSet()), (lossy, ke.BlockSet())]
    c = connect(d.socket)
    try:
        keys = KeyBatch.of_ids(b"kv/", _ids(0, 120), b"\x00\x00")  # the pool store's keys
        for chunk in range(0, 120, 8):  # 120 x 64 KiB through a 4 MiB window: LRU evicts
            part = KeyBatch(keys.matrix[chunk : chunk + 8])
            c.batch_put(part, [bytes(64 * KiB)] * 8)
            for sub, blocks in subs:
                sub.follow(blocks)
        c.put("greeting", b"hello")
        assert d.metric("kvfabric_pool_evicted_objects") > 0
        held = sorted(_directory(d) - {b"greeting"})
        node = _prefix(d, {"block_hashes": [b"greeting".hex()]})[1]["blocks"][0]["locations"][0]["node"]
        c.batch_remove(held[:5])
        # a client with a window of its own dies: its rank's blocks leave with it
        child = subprocess.Popen(
            [sys.executable, "-c", RANK_CHILD, d.socket],
            stdout=subprocess.PIPE,
            text=True,
            env=os.environ.copy(),
        )
        try:
            line = child.stdout.readline().split()
            assert line[:1] == ["ready"], line
            rank = int(line[1])
            dir_now = _converge(d, subs)
            assert {f"child/{i}".encode() for i in range(6)} <= dir_now
            medium, owner = subs[0][1].blocks[b"child/0"]
            assert medium == "CPU" and ke.parse_ownership(owner) == ("ev", rank, node)
        finally:
            child.kill()
            child.wait(30)
        deadline = time.monotonic() + 15
        while b"child/0" in _directory(d):
            assert time.monotonic() < deadline, "the dead rank's objects stayed in the directory"
            time.sleep(0.05)
        after_loss = _converge(d, subs)
        assert not any(k.startswith(b"child/") for k in after_loss)
        for sub, blocks in subs:
            assert blocks.keys() == after_loss, sub
        assert subs[0][1].blocks[held[-1]] == ("CPU", ke.ownership("ev", 0, node))
        # remove_all is one AllBlocksCleared; what comes after is stored again
        cleared_before = subs[0][1].cleared
        assert c.remove_all() > 0
        c.batch_put(KeyBatch.of_ids(b"kv/", _ids(1000, 10), b"\x00\x00"), [bytes(KiB)] * 10)
        final = _converge(d, subs)
        assert len(final) == 10 and subs[0][1].cleared == cleared_before + 1
        for sub, blocks in subs:
            assert blocks.keys() == final and sub.missing == 0
        assert lossy.gaps > 0 and early.connects >= 1  # gaps found and repaired; a join resyncs
        # a subscriber that joins now catches up from the replay buffer alone
        late = ke.Subscriber(pub, replay, decoder=DECODE)
        late_blocks = ke.BlockSet()
        c.put("last", b"x")
        assert _converge(d, [(late, late_blocks)]) == final | {b"last"} and late.connects == 1
        assert d.metric("kvfabric_pool_kv_event_replays_total") >= 3
        assert d.metric("kvfabric_pool_kv_events_dropped_total") == 0
        late.close()
    finally:
        c.close()
        for sub, _ in subs:
            sub.close()


def _prefix(d: Daemon, req: object) -> tuple[int, dict]:
    return _http(d, "/prefix", json.dumps(req).encode() if not isinstance(req, bytes) else req)


def test_prefix_query_finds_the_held_prefix_and_where_it_is(daemon):
    d = daemon
    c = connect(d.socket)
    try:
        ids = _ids(500, 6)
        hexes = [bytes(r).hex() for r in ids]
        held = [0, 1, 2, 4, 5]  # block 3 is a hole
        c.batch_put(KeyBatch.of_ids(b"m/", ids[held], b"\x00\x00"), [bytes(KiB)] * len(held))
        c.batch_put(KeyBatch.of_ids(b"m/", ids[[0, 2]], b"\x00\x01"), [bytes(KiB)] * 2)  # shard 1 of 0, 2
        code, out = _prefix(d, {"block_ids": hexes, "prefix": "m"})
        assert code == 200 and (out["queried"], out["prefix_blocks"]) == (6, 3)
        assert [b["block"] for b in out["blocks"]] == hexes[:3]
        (loc,) = out["blocks"][0]["locations"]
        assert (loc["shard"], loc["rank"], loc["tier"], loc["medium"], loc["locality"]) == (
            0,
            0,
            "dram",
            "CPU",
            "LOCAL",
        )
        assert isinstance(loc["node"], str) and loc["node"]
        assert (
            _prefix(d, {"block_ids": hexes[3:], "prefix": "m"})[1]["prefix_blocks"] == 0
        )  # starts at the hole
        assert _prefix(d, {"block_ids": hexes[4:], "prefix": "m"})[1]["prefix_blocks"] == 2
        code, out = _prefix(d, {"block_ids": hexes, "prefix": "m", "shards": 2})
        assert out["prefix_blocks"] == 1 and [x["shard"] for x in out["blocks"][0]["locations"]] == [0, 1]
        assert _prefix(d, {"block_ids": hexes})[1]["prefix_blocks"] == 0  # prefix "kv": none of these
        c.remove(ke.block_key("m", bytes(ids[1])))  # a hole made by a removal
        assert _prefix(d, {"block_ids": hexes, "prefix": "m"})[1]["prefix_blocks"] == 1
        # the hashes of the KV events (the pool keys) work as they are
        keys = [ke.block_key("m", bytes(ids[0])).hex(), b"greeting".hex()]
        c.put("greeting", b"hi")
        code, out = _prefix(d, {"block_hashes": keys})
        assert code == 200 and out["prefix_blocks"] == 2 and out["blocks"][1]["locations"][0]["shard"] is None
        # bad input: 400 naming the field
        for req, field in (
            ({"block_ids": ["xyz"]}, "block_ids[0]"),
            ({"block_ids": hexes, "shards": -1}, "shards"),
            ({"tokens": [1, 2]}, "unknown field(s) tokens"),
            (b"not json", "not JSON"),
        ):
            code, out = _prefix(d, req)
            assert code == 400 and field in out["error"], (req, out)
        assert _http(d, "/nowhere", b"{}")[0] == 404
        # a router's route: vLLM's block hashes + the engine's fingerprint -> the connector's ids
        fp = Fingerprint("m", "bfloat16", "2x4x1KiB", block_size=16)
        engine_hashes = [bytes([i]) * 32 for i in range(8)]  # vLLM's sha256 block hashes
        ids = routing.pool_block_ids(fp, engine_hashes)
        c.batch_put(KeyBatch.of_ids(b"kv/", ids[:5], b"\x00\x00"), [bytes(KiB)] * 5)
        got = routing.held_prefix(f"127.0.0.1:{d.ready['http_port']}", ids, fp.block_size)
        assert (got.blocks, got.tokens) == (5, 80) and got.locations[0][0]["rank"] == 0
        with pytest.raises(ValueError, match="shards"):
            routing.held_prefix(f"127.0.0.1:{d.ready['http_port']}", ids, 16, shards=0)
    finally:
        c.close()


def _until(pred, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "not reached in time"


def test_a_restarted_publisher_is_followed_from_its_snapshot(isolated_shm):
    port, rport = free_port(), free_port()
    cfg = PoolConfig(
        dram=1 * MiB,
        max_objects=256,
        pretouch=False,
        kv_events_endpoint=f"tcp://127.0.0.1:{port}",
        kv_events_replay_endpoint=f"tcp://127.0.0.1:{rport}",
    )
    sub = ke.Subscriber(cfg.kv_events_endpoint, cfg.kv_events_replay_endpoint, decoder=DECODE)
    blocks = ke.BlockSet()
    try:
        with EmbeddedPool(cfg) as pool:
            c = pool.client()
            for k in ("a", "b", "c"):
                c.put(k, b"v")
                _until(lambda k=k: sub.follow(blocks, 0.05) >= 0 and k.encode() in blocks.blocks)
            c.close()
        assert blocks.keys() == {b"a", b"b", b"c"} and sub.restarts == 0
        with EmbeddedPool(cfg) as pool:  # a new pool on the same addresses: numbers from 0 again
            c = pool.client()
            c.put("d", b"v")
            _until(lambda: sub.follow(blocks, 0.05) >= 0 and blocks.keys() == {b"d"})
            c.close()
        assert sub.restarts == 1 and sub.missing == 0
    finally:
        sub.close()


def test_a_publisher_that_falls_behind_drops_and_resyncs_with_a_snapshot(isolated_shm):
    cfg = PoolConfig(
        dram=1 * MiB,
        max_objects=256,
        pretouch=False,
        kv_events_endpoint="tcp://127.0.0.1:0",
        kv_events_replay_endpoint="tcp://127.0.0.1:0",
        kv_events_queue=4,  # 4 keys may wait for the publisher thread
    )
    with EmbeddedPool(cfg) as pool:
        pub = pool.events
        assert pub is not None
        sub = ke.Subscriber(pub.endpoint, pub.replay_endpoint, decoder=DECODE)
        blocks = ke.BlockSet()
        c = pool.client()
        try:
            c.batch_put([f"k{i}" for i in range(10)], [b"v"] * 10)  # 10 keys in one commit: dropped
            c.remove("k3")
            want = {f"k{i}".encode() for i in range(10)} - {b"k3"}
            _until(lambda: sub.follow(blocks, 0.05) >= 0 and blocks.keys() == want)
            m = pub.metrics()
            assert m["dropped"] >= 10 and m["snapshots"] >= 2 and sub.missing == 0
        finally:
            c.close()
            sub.close()


def test_a_busy_kv_events_port_fails_the_start_naming_it(isolated_shm):
    import zmq

    busy = zmq.Context.instance().socket(zmq.PUB)
    port = busy.bind_to_random_port("tcp://127.0.0.1")
    try:
        cfg = PoolConfig(
            dram=1 * MiB, max_objects=64, pretouch=False, kv_events_endpoint=f"tcp://127.0.0.1:{port}"
        )
        with pytest.raises(OSError, match=f"kv_events: cannot bind 'tcp://127.0.0.1:{port}'"):
            EmbeddedPool(cfg)
        assert segments(isolated_shm) == []  # the failed start left nothing behind
    finally:
        busy.close(linger=0)
