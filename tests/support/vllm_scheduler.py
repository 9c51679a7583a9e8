"""vLLM's own ``Scheduler`` with kvfabric's connector, no model running (as vLLM's
connector unit tests drive theirs): the config, the scheduler over given KV cache groups,
and requests with vLLM's block hasher."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any


def scheduler(
    model_dir: str,
    transfer: dict[str, Any],
    groups: Sequence[tuple[Sequence[str], Any]],
    *,
    block_size: int,
    num_blocks: int,
    prefix_caching: bool = False,
    kv_events: dict[str, Any] | None = None,
) -> Any:
    """A ``Scheduler`` for ``model_dir`` with ``transfer`` (a kv_transfer_config dict) and
    one KV cache group per ``(layer names, spec)``; ``kv_events``: a kv_events_config dict."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVEventsConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    vc = VllmConfig(
        model_config=ModelConfig(
            model=model_dir, dtype="float32", seed=0, max_model_len=1024, skip_tokenizer_init=True
        ),
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching),
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=1024,
            max_model_len=1024,
            async_scheduling=False,
            is_encoder_decoder=False,
        ),
        kv_transfer_config=KVTransferConfig(**transfer),
        kv_events_config=KVEventsConfig(**kv_events) if kv_events is not None else None,
        device_config=DeviceConfig("cpu"),
    )
    vc.cache_config.num_gpu_blocks = num_blocks
    kcc = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(list(layers), spec) for layers, spec in groups],
    )
    return Scheduler(vc, kcc, StructuredOutputManager(vc), block_size=block_size, log_stats=True)


def request(
    rid: str, tokens: list[int], block_size: int, max_tokens: int = 2, params: dict | None = None
) -> Any:
    """A vLLM ``Request`` of ``tokens`` (greedy, no EOS), its block hashes from vLLM's
    hasher; ``params``: its ``kv_transfer_params``."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    if params is not None:
        sp.extra_args = {"kv_transfer_params": params}
    return Request(rid, tokens, sp, None, block_hasher=get_request_block_hasher(block_size, sha256))


def step(
    sched: Any,
    *,
    invalid: set[int] | None = None,
    sending: set[str] | None = None,
    recving: set[str] | None = None,
    failed: set[str] | None = None,
) -> tuple[Any, Any, Any]:
    """One engine step: ``schedule``, then the model output (one sampled token per
    request) with the workers' report: ``invalid`` blocks whose load failed, requests
    whose dumps released their blocks (``sending``), whose async load ended (``recving``)
    or failed (``failed``, reported as ended too). Returns (the step's plan, the
    ``SchedulerOutput``, the engine outputs)."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    out = sched.schedule()
    ids = list(out.num_scheduled_tokens)
    mro = ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[7] for _ in ids],
        kv_connector_output=KVConnectorOutput(
            invalid_block_ids=set(invalid or ()),
            finished_sending=set(sending or ()) or None,
            finished_recving=set(recving or ()) | set(failed or ()) or None,
            failed_recving=set(failed or ()),
        ),
    )
    return out.kv_connector_metadata.plan, out, sched.update_from_output(out, mro)
