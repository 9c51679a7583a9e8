"""The connector on the kvfabric pool inside a real vLLM engine (CPU build), greedy.

``cache|pool`` with a pool embedded in the engine's process, with vLLM's KV events and
the connector's spans on: a ZMQ subscriber on 127.0.0.1 decodes vLLM's event stream with
vLLM's own decoder and finds kvfabric's ``BlockStored`` for exactly the blocks the pool
holds (medium ``CPU``, ownership ``kvfabric:pool``, vLLM's hashes and the prompt's
tokens), and the OpenTelemetry SDK's in-memory exporter has one ``kvfabric.request`` root
per request with its lookup, load and dump children inside it; two engine processes
sharing one pool daemon (the second gets the first one's prefix); the pool daemon killed
between runs (generation goes on, recomputing, with one clear warning per kind of failure).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
import time
import urllib.request

import numpy as np
import pytest
from pool_testing import Daemon

from kvfabric.harness.engine import BLOCK_SIZE, kvfabric_transfer_config, make_engine

PROMPT_LEN = 300
FULL_BLOCKS = (PROMPT_LEN - 1) // BLOCK_SIZE


def _prompt(seed: int, vocab: int = 512) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, PROMPT_LEN).tolist()


def _worker_totals(engine):
    return engine.worker().stats.totals


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Subscriber:
    """vLLM's KV event stream on 127.0.0.1, decoded with vLLM's own ``KVEventBatch``
    decoder: a SUB socket bound at ``endpoint`` (vLLM's publisher connects to it) and a
    client of the publisher's replay endpoint (``replay_endpoint``, bound by vLLM), which
    catches up on the batches a subscriber missed (a PUB socket drops what it sends
    before the subscription reached it)."""

    def __init__(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._zmq = zmq
        self._ctx = zmq.Context()
        self.sock = self._ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.bind("tcp://127.0.0.1:0")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = f"tcp://127.0.0.1:{_free_port()}"
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.batches: dict[int, list] = {}  # sequence number -> events
        self.replayed = 0

    def _add(self, seq: bytes, payload: bytes) -> None:
        self.batches.setdefault(int.from_bytes(seq, "big"), self._decoder.decode(payload).events)

    def drain(self, seconds: float) -> None:
        """Read what arrives within ``seconds`` after the last message."""
        while self.sock.poll(int(seconds * 1000)):
            _topic, seq, payload = self.sock.recv_multipart()
            self._add(seq, payload)

    def replay(self, start: int = 0, timeout_s: float = 10.0) -> None:
        """Ask the publisher for every batch from ``start`` on (up to its end marker)."""
        zmq = self._zmq
        req = self._ctx.socket(zmq.DEALER)
        req.connect(self.replay_endpoint)
        try:
            req.send_multipart((b"", start.to_bytes(8, "big")))
            while req.poll(int(timeout_s * 1000)):
                _empty, _topic, seq, payload = req.recv_multipart()
                if int.from_bytes(seq, "big", signed=True) == -1:
                    return
                self._add(seq, payload)
                self.replayed += 1
            raise AssertionError("the replay endpoint did not answer")
        finally:
            req.close(linger=0)

    @property
    def events(self) -> list:
        return [e for seq in sorted(self.batches) for e in self.batches[seq]]

    def close(self) -> None:
        self.sock.close(linger=0)
        self._ctx.term()


def _connector_ids(hasher, events: list) -> np.ndarray:
    """The connector's block ids of the blocks ``events`` (vLLM's ``BlockStored``, in stream
    order) announce: each run's ids chained from the id of its parent block."""
    id_of: dict[bytes, np.ndarray] = {}
    rows = []
    for e in events:
        parent = None
        if e.parent_block_hash is not None:
            parent = id_of[e.parent_block_hash]  # announced before its children
        for h, row in zip(e.block_hashes, hasher.hash_engine(e.block_hashes, parent), strict=True):
            id_of[h] = row
            rows.append(row)
    return np.stack(rows)


@pytest.fixture
def spans():
    """An in-memory span exporter the connectors built meanwhile trace into."""
    sdk = pytest.importorskip("opentelemetry.sdk.trace")
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from kvfabric.ucm_layer.connector import tracing

    exporter = InMemorySpanExporter()
    provider = sdk.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use_tracer_provider(provider)
    try:
        yield exporter
    finally:
        tracing.use_tracer_provider(None)


def test_cache_pool_same_prompt_twice(tiny_model, monkeypatch, spans):
    from vllm.distributed.kv_events import BlockStored

    from kvfabric.ucm_layer.connector import tracing

    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")  # hashes as bytes, as vLLM keeps them
    sub = Subscriber()
    cfg = kvfabric_transfer_config("cache|pool", cache_bytes="64MiB", pool_bytes="128MiB")
    eng = make_engine(
        tiny_model,
        cfg,
        kv_bytes=64 << 20,
        kv_events={
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": sub.endpoint,
            "replay_endpoint": sub.replay_endpoint,
        },
    )
    try:
        prompt = _prompt(11)
        first = eng.generate([prompt], 12)
        eng.flush()
        assert _worker_totals(eng)["saved_blocks"] >= FULL_BLOCKS
        second = eng.generate([prompt], 12)  # its steps carry the first run's dump reports
        assert second == first
        assert _worker_totals(eng)["loaded_blocks"] == FULL_BLOCKS
        sub.drain(0.5)
        sub.replay(0)  # whatever the subscription missed

        # KV events: kvfabric's blocks, each once, are exactly what the pool holds
        ours = [e for e in sub.events if isinstance(e, BlockStored) and e.ownership == "kvfabric:pool"]
        hashes = [h for e in ours for h in e.block_hashes]
        assert len(hashes) == len(set(hashes)) == FULL_BLOCKS
        assert {e.medium for e in ours} == {"CPU"} and {e.locality for e in ours} == {"LOCAL"}
        assert [t for e in ours for t in e.token_ids] == prompt[: FULL_BLOCKS * BLOCK_SIZE]
        assert ours[0].parent_block_hash is None and all(e.block_size == BLOCK_SIZE for e in ours)
        chain = [e.parent_block_hash for e in ours[1:]]
        assert chain == [e.block_hashes[-1] for e in ours[:-1]]  # each run follows the last
        sched = next(c for c in eng.connectors() if c.scheduler is not None)
        ids = _connector_ids(sched._hasher, ours)  # the connector's ids of those vLLM blocks
        pool = eng.worker().store.lower
        assert pool.lookup(ids).all()
        assert pool.client.info()["objects"] == FULL_BLOCKS  # and the pool holds nothing else
        assert sorted(sub.batches) == list(range(len(sub.batches)))  # no batch missing

        # spans: a root per request, its children inside it, across the roles
        done = spans.get_finished_spans()
        roots = {s.context.span_id: s for s in done if s.name == tracing.ROOT}
        assert len(roots) == 2
        kids = [s for s in done if s.name != tracing.ROOT]
        for s in kids:
            root = roots[s.parent.span_id]
            assert s.context.trace_id == root.context.trace_id
            assert root.start_time <= s.start_time < s.end_time <= root.end_time, s.name
        names = sorted(
            (s.name, s.attributes["req_id"] == roots[s.parent.span_id].attributes["req_id"]) for s in kids
        )
        assert {n for n, _ in names} == {tracing.LOOKUP, tracing.LOAD, tracing.DUMP} and all(
            m for _, m in names
        )
        (load,) = [s for s in kids if s.name == tracing.LOAD]
        assert load.attributes["blocks"] == FULL_BLOCKS and load.attributes["store_tier"] in ("cache", "pool")
        warm = roots[load.parent.span_id]
        assert warm.attributes["hit_tokens"] == FULL_BLOCKS * BLOCK_SIZE
        assert warm.attributes["hit_rate"] == pytest.approx(FULL_BLOCKS * BLOCK_SIZE / PROMPT_LEN)
        assert warm.attributes["requested_tokens"] == PROMPT_LEN and warm.attributes["store"] == "cache|pool"
    finally:
        eng.close()
        sub.close()


CHILD = textwrap.dedent(
    """
    import json, sys
    from kvfabric.harness.engine import kvfabric_transfer_config, make_engine
    model, socket, prompt = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    cfg = kvfabric_transfer_config("pool", pool_address=socket)
    eng = make_engine(model, cfg, kv_bytes=64 << 20, in_process=False)
    out = eng.generate([prompt], 12)
    eng.close()
    print("KVF-RESULT " + json.dumps({"tokens": out}))
    """
)


def _directory(daemon: Daemon) -> set[bytes]:
    """Every key the daemon's directory holds (its ``/keys`` pages)."""
    from kvfabric.pool.keys import key_from_text

    keys: list[str] = []
    start: int | None = 0
    while start is not None:
        url = f"http://127.0.0.1:{daemon.ready['http_port']}/keys?start={start}&limit=10000"
        with urllib.request.urlopen(url, timeout=10) as r:
            page = json.load(r)
        keys += page["keys"]
        start = page["next"]
    return {key_from_text(k) for k in keys}


def test_two_engine_processes_share_one_pool_daemon(tiny_model, tmp_path, monkeypatch):
    """The second engine gets the first one's prefix; it then stores ten more prompts
    through a 4 MiB pool (64 blocks of 64 KiB: the pool evicts). The daemon's KV events
    rebuild exactly its directory, and every block the engine's vLLM events announce
    (kvfabric's BlockStored) was announced stored by the daemon under its pool key."""
    import msgspec
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    from kvfabric.pool import kv_events as ke

    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    events = {"kv_events_endpoint": "tcp://127.0.0.1:0", "kv_events_replay_endpoint": "tcp://127.0.0.1:0"}
    daemon = Daemon(tmp_path, name="e2e", dram="4MiB", extra=events).start()
    pool_sub = ke.Subscriber(
        daemon.ready["kv_events_endpoint"],
        daemon.ready["kv_events_replay_endpoint"],
        decoder=msgspec.msgpack.Decoder(type=KVEventBatch).decode,
    )
    pool_blocks, pool_stored = ke.BlockSet(), set()

    def follow(timeout_s: float = 0.02) -> int:
        got = pool_sub.poll(timeout_s)
        for _, batch in got:
            pool_blocks.apply(batch)
            pool_stored.update(
                h for e in batch.events if type(e).__name__ == "BlockStored" for h in e.block_hashes
            )
        return len(got)

    sub = Subscriber()
    try:
        prompt = _prompt(12)
        out = subprocess.run(
            [sys.executable, "-c", CHILD, tiny_model, daemon.socket, json.dumps(prompt)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("KVF-RESULT ")]
        assert out.returncode == 0 and lines, out.stderr[-3000:]
        child = json.loads(lines[-1].split(" ", 1)[1])["tokens"]
        eng = make_engine(
            tiny_model,
            kvfabric_transfer_config("pool", pool_address=daemon.socket),
            kv_bytes=64 << 20,
            kv_events={
                "enable_kv_cache_events": True,
                "endpoint": sub.endpoint,
                "replay_endpoint": sub.replay_endpoint,
            },
        )
        try:
            mine = eng.generate([prompt], 12)
            assert mine == child
            assert _worker_totals(eng)["loaded_blocks"] == FULL_BLOCKS
            follow()
            eng.generate([_prompt(100 + i) for i in range(10)], 2)  # 90 more blocks: evictions
            eng.flush()
            eng.generate([_prompt(12)[:20]], 1)  # its steps carry the last dump reports
            stored_by_engine = _worker_totals(eng)["saved_blocks"]
            assert 0 < stored_by_engine <= 10 * FULL_BLOCKS
            sub.drain(0.3)
            sub.replay(0)
            sched = next(c for c in eng.connectors() if c.scheduler is not None)
            ours = [e for e in sub.events if isinstance(e, BlockStored) and e.ownership == "kvfabric:pool"]
            hashes = [h for e in ours for h in e.block_hashes]
            assert len(hashes) == len(set(hashes)) == stored_by_engine
            ids = _connector_ids(sched._hasher, ours)
        finally:
            eng.close()
        assert daemon.metric("kvfabric_pool_evicted_objects") > 0
        deadline = time.monotonic() + 15
        while True:  # the daemon's stream settles on its directory
            want = _directory(daemon)
            if not follow() and pool_blocks.keys() != want:
                pool_sub.resync(pool_blocks)
            if pool_blocks.keys() == want:
                break
            assert time.monotonic() < deadline, len(pool_blocks.keys() ^ want)
        assert pool_sub.missing == 0 and len(want) < 11 * FULL_BLOCKS  # evicted, rebuilt exactly
        keys = {ke.block_key("kv", row.tobytes()) for row in ids}
        assert keys <= pool_stored  # each block the engine announced, the daemon stored
        assert keys & want and keys - want  # some are still held, some were evicted
    finally:
        sub.close()
        pool_sub.close()
        daemon.stop()


def test_pool_daemon_killed_between_runs_recomputes_with_one_warning(tiny_model, tmp_path, caplog):
    daemon = Daemon(tmp_path, name="e2ekill", dram="128MiB").start()
    eng = make_engine(
        tiny_model, kvfabric_transfer_config("pool", pool_address=daemon.socket), kv_bytes=64 << 20
    )
    try:
        prompt = _prompt(13)
        ref = eng.generate([prompt], 12)
        eng.flush()
        assert eng.generate([prompt], 12) == ref  # warm: loaded from the pool
        daemon.kill()
        with caplog.at_level(logging.WARNING):
            again = [eng.generate([prompt], 12) for _ in range(3)]
            eng.flush()
        assert again == [ref] * 3
        ours = [r for r in caplog.records if r.name.startswith("kvfabric") and r.levelno >= logging.WARNING]
        said = [f"{r.name}: {r.getMessage()}" for r in ours]
        # one warning per kind of failure, however many requests meet it: the loads that
        # failed, the store that did not answer, and (vLLM recomputes and the connector
        # saves the repaired blocks again) the saves that failed
        kinds = [m for m in said if "loading KV blocks" in m], [m for m in said if "storing KV blocks" in m]
        assert [len(k) for k in kinds] == [1, 1], said
        assert len(said) <= 3 and "'pool'" in kinds[0][0], said  # the load warning names the store
        assert not [r for r in caplog.records if r.name.startswith("kvfabric") and r.exc_info]
    finally:
        eng.close()
        daemon.kill()
