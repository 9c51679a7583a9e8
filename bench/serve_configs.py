"""The configurations ``kvfabric bench serve`` compares: vLLM alone, the peer connectors
(with the platform conditions that make two of them refuse to start on a CPU build),
kvfabric's, and the kvfabric variants with one setting changed (``bench/serve.py`` has
the run; ``bench/serve_procs.py`` the processes)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvfabric.bench.serve_workload import ConfigKind, Preset


@dataclass(frozen=True)
class Config:
    """One configuration: a name, its kind, its ``kv_transfer_config`` (None: vLLM alone),
    whether it measures the floor, and whether it re-serves the saturation prefixes as a
    second engine."""

    name: str
    kind: ConfigKind
    transfer: dict[str, Any] | None
    floor: bool = False
    second_engine: bool = False
    needs_module: str | None = None  # a package the connector imports: checked before an engine starts
    refusal: Callable[[], str | None] | None = None  # the platform condition it refuses at start (--quick)


def offloading_refusal() -> str | None:
    """vLLM's CPU offloading spec builds its worker only on CUDA-alike and XPU platforms."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike() or current_platform.is_xpu():
        return None
    return (
        "Exception: CPU Offloading is currently only supported on CUDA-alike and XPU GPUs "
        f"(platform {type(current_platform).__name__}; checked before starting an engine)"
    )


def simple_offload_refusal() -> str | None:
    """vLLM's simple CPU offload worker asks ``torch.cuda.Stream.priority_range()``."""
    import torch

    if callable(getattr(torch.cuda.Stream, "priority_range", None)):
        return None
    return (
        "AttributeError: torch.cuda.Stream has no attribute 'priority_range' "
        "(this torch build has no CUDA streams; checked before starting an engine)"
    )


def configs(tmp: str, pool_socket: str, preset: Preset, bytes_per_token: int) -> list[Config]:
    """The configurations in run order (see the module docstring)."""
    from kvfabric.harness.engine import example_transfer_config, kvfabric_transfer_config

    tier = 3 * preset.working_set_tokens * bytes_per_token  # both phases and the floor fit
    pool = kvfabric_transfer_config("cache|pool", cache_bytes=str(tier), pool_address=pool_socket)
    offload = {"cpu_bytes_to_use": tier}

    def peer(name: str, extra: dict[str, Any] | None = None, **kw: Any) -> Config:
        """vLLM's in-tree connector ``name`` in both roles, with its extra config."""
        transfer: dict[str, Any] = {"kv_connector": name, "kv_role": "kv_both"}
        if extra is not None:
            transfer["kv_connector_extra_config"] = extra
        return Config(name, ConfigKind.PEER, transfer, **kw)

    return [
        Config("vllm", ConfigKind.BASELINE, None),
        Config("ExampleConnector", ConfigKind.PEER, example_transfer_config(f"{tmp}/example")),
        peer("OffloadingConnector", offload, refusal=offloading_refusal),
        peer("SimpleCPUOffloadConnector", offload, refusal=simple_offload_refusal),
        peer("LMCacheConnectorV1", needs_module="lmcache"),
        peer("MooncakeStoreConnector"),
        Config("kvfabric cache|pool", ConfigKind.KVFABRIC, pool, floor=True),
        Config("kvfabric posix", ConfigKind.KVFABRIC, kvfabric_transfer_config("posix", f"{tmp}/posix")),
        Config("kvfabric cache|pool, second engine", ConfigKind.KVFABRIC, pool, second_engine=True),
    ]


def variants(tmp: str, pool_socket: str, preset: Preset, bytes_per_token: int) -> list[Config]:
    """kvfabric with one setting changed, run only when ``KVFABRIC_BENCH_SERVE_CONFIGS``
    names them (to see what one part of the connector's path costs)."""
    from kvfabric.harness.engine import kvfabric_transfer_config

    tier = str(3 * preset.working_set_tokens * bytes_per_token)
    kvf = ConfigKind.KVFABRIC
    return [
        Config(
            "kvfabric cache|pool, sync load",
            kvf,
            kvfabric_transfer_config(
                "cache|pool", cache_bytes=tier, pool_address=pool_socket, async_load=False
            ),
        ),
        Config(
            "kvfabric cache|pool, delegator",  # dumps release vLLM's blocks once gathered
            kvf,
            kvfabric_transfer_config(
                "cache|pool", cache_bytes=tier, pool_address=pool_socket, delegator=True
            ),
        ),
        Config(
            "kvfabric cache|pool, write behind",  # dumps end once in the cache tier
            kvf,
            kvfabric_transfer_config(
                "cache|pool",
                cache_bytes=tier,
                pool_address=pool_socket,
                store_options={"pipeline.write": "behind"},
            ),
        ),
        Config(
            "kvfabric pool",
            kvf,
            kvfabric_transfer_config("pool", pool_address=pool_socket),
        ),
        Config("kvfabric cache", kvf, kvfabric_transfer_config("cache", cache_bytes=tier)),
        Config(
            "kvfabric posix, sync load",
            kvf,
            kvfabric_transfer_config("posix", f"{tmp}/posix-sync", async_load=False),
        ),
    ]


__all__ = ["Config", "configs", "offloading_refusal", "simple_offload_refusal", "variants"]
