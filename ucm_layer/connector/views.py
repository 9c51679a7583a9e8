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
    #: every token of the request so far (vLLM's list, not a copy; read for KV events only)
    token_ids: Sequence[int] = ()
    lora_id: int | None = None
    lora_name: str | None = None


@dataclass(frozen=True)
class NewReq:
    req_id: str
    block_ids: list[int]  # group 0's
    num_computed_tokens: int
    groups: tuple[list[int], ...] = ()  # every KV cache group's block ids (hybrid models)


@dataclass(frozen=True)
class CachedReq:
    req_id: str
    new_block_ids: list[int] | None  # group 0's
    resumed: bool
    num_computed_tokens: int
    new_groups: tuple[list[int], ...] = ()  # every KV cache group's new block ids (hybrid models)


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
    #: per KV cache group: its sliding window in tokens, None for full attention; empty
    #: when some group is of a kind kvfabric does not serve (``group_problem`` says why)
    group_windows: tuple[int | None, ...] = ()
    group_problem: str = ""
