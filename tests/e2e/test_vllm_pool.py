"""The connector on the kvfabric pool inside a real vLLM engine (CPU build), greedy.

``cache|pool`` with a pool embedded in the engine's process; two engine processes
sharing one pool daemon (the second gets the first one's prefix); the pool daemon killed
between runs (generation goes on, recomputing, with one clear warning per kind of failure).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap

import numpy as np
from pool_testing import Daemon

from kvfabric.harness.engine import BLOCK_SIZE, kvfabric_transfer_config, make_engine

PROMPT_LEN = 300
FULL_BLOCKS = (PROMPT_LEN - 1) // BLOCK_SIZE


def _prompt(seed: int, vocab: int = 512) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, PROMPT_LEN).tolist()


def _worker_totals(engine):
    return engine.worker().stats.totals


def test_cache_pool_same_prompt_twice(tiny_model):
    cfg = kvfabric_transfer_config("cache|pool", cache_bytes="64MiB", pool_bytes="128MiB")
    eng = make_engine(tiny_model, cfg, kv_bytes=64 << 20)
    try:
        prompt = _prompt(11)
        first = eng.generate([prompt], 12)
        eng.flush()
        assert _worker_totals(eng)["saved_blocks"] >= FULL_BLOCKS
        second = eng.generate([prompt], 12)
        assert second == first
        assert _worker_totals(eng)["loaded_blocks"] == FULL_BLOCKS
    finally:
        eng.close()


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


def test_two_engine_processes_share_one_pool_daemon(tiny_model, tmp_path):
    daemon = Daemon(tmp_path, name="e2e", dram="128MiB").start()
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
            tiny_model, kvfabric_transfer_config("pool", pool_address=daemon.socket), kv_bytes=64 << 20
        )
        try:
            mine = eng.generate([prompt], 12)
            assert mine == child
            assert _worker_totals(eng)["loaded_blocks"] == FULL_BLOCKS
        finally:
            eng.close()
    finally:
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
