"""The sparse backend's configuration, read from the vLLM config and validated at start-up.

Three places, all optional (the backend is a pass-through when neither names an algorithm):

``additional_config["kvfabric_sparse"]`` (``--additional-config '{"kvfabric_sparse": {...}}'``)
    ``algorithm``: a name of the sparse registry (``gsa``, ``quest``, ``meankey``, ``hata``,
    ``oracle``, ``dense``); ``stats_path``: a file the worker rewrites with the backend's
    counters after the steps (JSON, by a thread: current within about 0.25 s of the last
    step, at once when the worker exits; ``{rank}`` in the path is replaced by the worker's rank);
    every other key goes to the algorithm unchanged (``budget_tokens``, ``min_seq_len``,
    ``sink_blocks``, ``recent_blocks``, ``rank``, ... as ``BlockSparseConfig`` names them),
    except that a block-sparse algorithm given no ``min_skipped_kv`` gets the engine's
    cost-aware floor (``runtime.engine_options``).
``KVFABRIC_SPARSE`` (environment, read in every vLLM process)
    the same mapping as JSON, instead of ``additional_config`` (both set is an error).
``kv_transfer_config.kv_connector_extra_config["sparse"]`` (with ``KVFabricConnector``)
    the algorithm's name, as the connector's ``sparse`` key (``true`` = ``gsa``).

The mapping's ``algorithm`` and the connector's ``sparse`` naming different algorithms is
an error. ``KVFABRIC_SPARSE_BACKEND=0`` keeps the backends out of vLLM's registry. Option
values are validated when the first attention layer is built (the algorithm's own checks,
which name the key), so a bad value fails the engine's start-up.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvfabric.envs import EnvVar, _parse_bool

ADDITIONAL_KEY = "kvfabric_sparse"
CONNECTOR_NAME = "KVFabricConnector"


#: algorithm options the backend refuses (they need engine hooks vLLM does not expose)
def _parse_json_mapping(text: str) -> dict[str, Any]:
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    return data


KVFABRIC_SPARSE: EnvVar[dict[str, Any] | None] = EnvVar(
    "KVFABRIC_SPARSE",
    _parse_json_mapping,
    None,
    'The sparse backend\'s configuration as JSON (as additional_config["kvfabric_sparse"]).',
)
KVFABRIC_SPARSE_BACKEND: EnvVar[bool] = EnvVar(
    "KVFABRIC_SPARSE_BACKEND",
    _parse_bool,
    True,
    "Register kvfabric's attention backends in vLLM's registry (CPU_ATTN override, CUSTOM).",
)
REFUSED = {"offload": "offloading unselected blocks needs a scheduler hook vLLM does not expose"}


@dataclass(frozen=True)
class SparseBackendConfig:
    """``algorithm`` None: the backend leaves every layer to the wrapped impl untouched."""

    algorithm: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    stats_path: str | None = None

    def __post_init__(self) -> None:
        where = f"additional_config[{ADDITIONAL_KEY!r}]"
        if self.algorithm is not None:
            from kvfabric.ucm_layer.sparse.base import ALGORITHMS

            if self.algorithm not in ALGORITHMS:
                raise ValueError(
                    f"{where}['algorithm'] must be one of {', '.join(ALGORITHMS.names())}, "
                    f"got {self.algorithm!r}"
                )
        if self.stats_path is not None and (not isinstance(self.stats_path, str) or not self.stats_path):
            raise ValueError(f"{where}['stats_path'] must be a non-empty path, got {self.stats_path!r}")
        for key, why in REFUSED.items():
            if self.options.get(key):
                raise ValueError(f"{where}[{key!r}] is not supported in vLLM: {why}")

    @property
    def enabled(self) -> bool:
        return self.algorithm is not None


def _connector_algorithm(vllm_config: Any) -> str | None:
    kvt = getattr(vllm_config, "kv_transfer_config", None)
    if kvt is None or getattr(kvt, "kv_connector", None) != CONNECTOR_NAME:
        return None
    extra = getattr(kvt, "kv_connector_extra_config", None) or {}
    if "sparse" not in extra:
        return None
    from kvfabric.ucm_layer.connector.config import _as_sparse

    return _as_sparse("sparse", extra["sparse"])


def from_mapping(
    section: Mapping[str, Any] | None, connector_algorithm: str | None = None
) -> SparseBackendConfig:
    """Build from ``additional_config["kvfabric_sparse"]`` and the connector's ``sparse``."""
    if section is not None and not isinstance(section, Mapping):
        raise TypeError(
            f"additional_config[{ADDITIONAL_KEY!r}] must be a mapping, got {type(section).__name__}"
        )
    opts = dict(section or {})
    algorithm = opts.pop("algorithm", None)
    if algorithm is not None:
        if not isinstance(algorithm, str):
            raise ValueError(
                f"additional_config[{ADDITIONAL_KEY!r}]['algorithm'] must be a name, got {algorithm!r}"
            )
        algorithm = algorithm.strip().lower()
    if connector_algorithm is not None and algorithm is not None and algorithm != connector_algorithm:
        raise ValueError(
            f"additional_config[{ADDITIONAL_KEY!r}]['algorithm'] ({algorithm!r}) contradicts the "
            f"connector's kv_connector_extra_config['sparse'] ({connector_algorithm!r})"
        )
    algorithm = algorithm or connector_algorithm
    stats_path = opts.pop("stats_path", None)
    if opts and algorithm is None:
        raise ValueError(
            f"additional_config[{ADDITIONAL_KEY!r}] has options {sorted(opts)} but no 'algorithm' "
            "(and the connector's 'sparse' is off)"
        )
    return SparseBackendConfig(algorithm=algorithm, options=opts, stats_path=stats_path)


def from_vllm_config(vllm_config: Any) -> SparseBackendConfig:
    """The configuration of the engine being built (``get_current_vllm_config()``)."""
    additional = getattr(vllm_config, "additional_config", None) or {}
    section, env = additional.get(ADDITIONAL_KEY), KVFABRIC_SPARSE.get()
    if section is not None and env is not None:
        raise ValueError(
            f"give the sparse configuration once: additional_config[{ADDITIONAL_KEY!r}] or KVFABRIC_SPARSE"
        )
    return from_mapping(section if section is not None else env, _connector_algorithm(vllm_config))


__all__ = [
    "ADDITIONAL_KEY",
    "KVFABRIC_SPARSE",
    "KVFABRIC_SPARSE_BACKEND",
    "SparseBackendConfig",
    "from_mapping",
    "from_vllm_config",
]
