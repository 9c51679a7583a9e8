"""The connector in the executor shapes vLLM runs by default, on the CPU build.

vLLM's default multiprocessing (``VLLM_ENABLE_V1_MULTIPROCESSING=1``, as under ``vllm
serve``): the engine core (the scheduler connector) and the worker (the worker connector)
are separate processes. With the README's configuration and no ``pool_address`` the
first of them starts the node's pool daemon and the other joins it, so the same prompt
twice loads every full block the first run stored, with the same tokens; the daemon goes
away after the engine (no process, no shared-memory segment left). The connector's spans
go to an OTLP/HTTP receiver on 127.0.0.1 from both processes: each request's
``kvfabric.request`` root (the scheduler's process) is the parent of its ``kvfabric.load``
/ ``kvfabric.dump`` spans (the worker's process, linked through the traceparent the step
plan carried), which lie inside it. A ``cache`` store alone cannot be shared by those
processes: with the configuration vLLM builds for that shape, the connector refuses to
start, naming the fix.
"""

from __future__ import annotations

import gzip
import threading
import time
from typing import Any

import numpy as np
import pytest
from daemon_exit import gone, wait_gone
from kvf_testing import segments

from kvfabric.harness.engine import BLOCK_SIZE, kvfabric_transfer_config, make_engine, pool_transfer_config
from kvfabric.pool.autostart import daemon_pid, probe

PROMPT_LEN = 300
FULL_BLOCKS = (PROMPT_LEN - 1) // BLOCK_SIZE  # the block of the last prompt token is never loaded
POOL = "e2e-shapes"


def _prompt(seed: int, vocab: int = 512) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, PROMPT_LEN).tolist()


def _run(engine, prompt: list[int], max_tokens: int = 12) -> tuple[list[int], int]:
    """Tokens of one greedy request and the prompt tokens it did not compute (vLLM's
    ``num_cached_tokens``: with vLLM's own prefix cache off, the connector's hits)."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = engine.llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)


class Collector:
    """An OTLP/HTTP trace receiver on 127.0.0.1, what a collector would be: every span it
    is sent, with the ``process.pid`` of the exporting process's resource."""

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        self.spans: list[tuple[int, Any]] = []
        lock = threading.Lock()
        spans = self.spans

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                with lock:
                    for rs in req.resource_spans:
                        attrs = {a.key: a.value for a in rs.resource.attributes}
                        pid = attrs["process.pid"].int_value if "process.pid" in attrs else -1
                        spans.extend((pid, sp) for ss in rs.scope_spans for sp in ss.spans)
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def named(self, name: str) -> list[tuple[int, Any]]:
        return [(pid, s) for pid, s in list(self.spans) if s.name == name]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def collector(monkeypatch):
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http.trace_exporter")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # vLLM's processes export within 0.1 s
    c = Collector()
    yield c
    c.close()


def _attr(span: Any, key: str) -> Any:
    for a in span.attributes:
        if a.key == key:
            v = a.value
            return getattr(v, v.WhichOneof("value"))
    raise KeyError(key)


def _check_spans(collector: Collector, timeout_s: float = 20.0) -> None:
    """Both requests' roots, the warm one's load and the cold one's dumps arrived, linked
    across the two processes, children inside their roots."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        roots, loads = collector.named("kvfabric.request"), collector.named("kvfabric.load")
        if len(roots) >= 2 and loads and collector.named("kvfabric.dump"):
            break
        time.sleep(0.1)
    roots = {s.span_id: (pid, s) for pid, s in collector.named("kvfabric.request")}
    assert len(roots) == 2, [s.name for _, s in collector.spans]
    worker_spans = collector.named("kvfabric.load") + collector.named("kvfabric.dump")
    assert {s.name for _, s in worker_spans} == {"kvfabric.load", "kvfabric.dump"}
    for pid, s in worker_spans + collector.named("kvfabric.lookup"):
        root_pid, root = roots[s.parent_span_id]
        assert s.trace_id == root.trace_id
        assert root.start_time_unix_nano <= s.start_time_unix_nano < s.end_time_unix_nano
        assert s.end_time_unix_nano <= root.end_time_unix_nano, s.name
        assert _attr(s, "req_id") == _attr(root, "req_id")
        if s.name != "kvfabric.lookup":  # the worker's spans: another process than the root's
            assert pid != root_pid and pid > 0
    ((_, load),) = collector.named("kvfabric.load")
    assert _attr(load, "blocks") == FULL_BLOCKS and _attr(load, "store_tier") in ("cache", "pool")
    _, warm = roots[load.parent_span_id]
    assert _attr(warm, "hit_tokens") == FULL_BLOCKS * BLOCK_SIZE and _attr(warm, "store") == "cache|pool"


@pytest.fixture
def runtime(tmp_path, monkeypatch):
    """The auto-started daemon's socket under the test's directory (vLLM's processes
    inherit the environment)."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    return tmp_path


def test_readme_config_with_vllm_multiprocessing_hits_through_the_auto_started_daemon(
    tiny_model, runtime, isolated_shm, collector
):
    sock = str(runtime / f"kvfabric-pool-{POOL}.sock")
    cfg = pool_transfer_config(POOL, "64MiB", "128MiB", otlp_endpoint=collector.endpoint)
    eng = make_engine(tiny_model, cfg, kv_bytes=64 << 20, in_process=False)
    try:
        prompt = _prompt(21)
        first, cached = _run(eng, prompt)
        assert cached == 0
        info = probe(sock)
        assert info is not None and info["name"] == POOL  # the worker process started it
        pid = daemon_pid(sock)
        assert pid is not None and not gone(pid)
        second, cached = _run(eng, prompt)
        assert second == first
        assert cached == FULL_BLOCKS * BLOCK_SIZE  # every full block came from the pool
        _check_spans(collector)
    finally:
        eng.close()
    wait_gone(pid, sock, timeout=60)  # with its last client
    assert segments(isolated_shm) == []


def test_a_cache_alone_across_vllm_processes_is_refused_at_start(tiny_model, monkeypatch):
    """The configuration vLLM builds for its default multiprocessing (``mp`` executor on
    the CPU build) makes the scheduler's connector refuse a store of one process, naming
    the fix. Built from vLLM's own ``EngineArgs`` without starting an engine: the engine
    would raise the same error from its core process at start-up."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs

    from kvfabric.ucm_layer.connector.connector import KVFabricConnector

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    transfer = KVTransferConfig(**kvfabric_transfer_config("cache", cache_bytes="64MiB"))
    args = EngineArgs(
        model=tiny_model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        block_size=BLOCK_SIZE,
        kv_cache_memory_bytes=64 << 20,
        kv_transfer_config=transfer,
    )
    config = args.create_engine_config()
    assert config.parallel_config.distributed_executor_backend == "mp"  # vLLM's own choice
    with pytest.raises(ValueError, match="keeps its blocks in the memory of one process") as e:
        KVFabricConnector(config, KVConnectorRole.SCHEDULER)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING=0" in str(e.value) and "'cache|pool'" in str(e.value)
