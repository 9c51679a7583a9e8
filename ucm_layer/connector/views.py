"""Plain values the connector's roles work on (what ``compat.py`` reads out of vLLM)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ReqView:
    """What the scheduler role reads from a vLLM ``Request``."""

    req_id: str
    block_hashes: Sequence[bytes]
    num_tokens: int
    num_prompt_tokens: int
    transfer_params: Mapping[str, Any] | None = None  # the request's kv_transfer_params (P/D)


@dataclass(frozen=True)
class NewReq:
    req_id: str
    block_ids: list[int]
    num_computed_tokens: int


@dataclass(frozen=True)
class CachedReq:
    req_id: str
    new_block_ids: list[int] | None
    resumed: bool
    num_computed_tokens: int


@dataclass(frozen=True)
class EngineInfo:
    """Facts about the engine the connector serves, read from ``VllmConfig``."""

    model: str
    dtype: str
    block_size: int
    hash_block_size: int
    num_blocks: int | None
    tp_size: int
    use_mla: bool
    kv_producer: bool
    kv_consumer: bool
    block_strides: dict[str, int]
    single_group: bool
    device_type: str = "cpu"  # where vLLM keeps the KV cache: "cpu", "cuda", "npu", ...
    pp_size: int = 1  # pipeline-parallel stages (kvfabric refuses more than one)
