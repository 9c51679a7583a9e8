"""The connector in the executor shapes vLLM runs by default, on the CPU build.

vLLM's default multiprocessing (``VLLM_ENABLE_V1_MULTIPROCESSING=1``, as under ``vllm
serve``): the engine core (the scheduler connector) and the worker (the worker connector)
are separate processes. With the README's configuration and no ``pool_address`` the
first of them starts the node's pool daemon and the other joins it, so the same prompt
twice loads every full block the first run stored, with the same tokens; the daemon goes
away after the engine (no process, no shared-memory segment left). A ``cache`` store
alone cannot be shared by those processes: the engine refuses to start, naming the fix.
"""

from __future__ import annotations

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


@pytest.fixture
def runtime(tmp_path, monkeypatch):
    """The auto-started daemon's socket under the test's directory (vLLM's processes
    inherit the environment)."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    return tmp_path


def test_readme_config_with_vllm_multiprocessing_hits_through_the_auto_started_daemon(
    tiny_model, runtime, isolated_shm
):
    sock = str(runtime / f"kvfabric-pool-{POOL}.sock")
    cfg = pool_transfer_config(POOL, "64MiB", "128MiB")
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
    finally:
        eng.close()
    wait_gone(pid, sock, timeout=60)  # with its last client
    assert segments(isolated_shm) == []


def test_a_cache_alone_across_vllm_processes_is_refused_at_start(tiny_model, capfd):
    cfg = kvfabric_transfer_config("cache", cache_bytes="64MiB")
    with pytest.raises(Exception):  # noqa: B017 - vLLM reports the engine core's failure as its own
        make_engine(tiny_model, cfg, kv_bytes=64 << 20, in_process=False).close()
    err = capfd.readouterr().err  # the engine core process's traceback
    assert "keeps its blocks in the memory of one process" in err
    assert "VLLM_ENABLE_V1_MULTIPROCESSING=0" in err and "'cache|pool'" in err
