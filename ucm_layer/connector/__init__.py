"""kvfabric's vLLM KV connector: ``KVFabricConnector`` (scheduler and worker roles).

vLLM imports ``KVFabricConnector`` from here (``kv_connector_module_path =
"kvfabric.ucm_layer.connector"``); the attribute is resolved lazily, so importing this
package does not import vLLM or torch. The parts: ``compat`` (the only module that
imports vLLM), ``config``, ``scheduler`` / ``worker`` (the two roles on plain values),
``plan`` (the step plan), ``loads`` (asynchronous loads in flight), ``handoff`` (the
P/D hand-off), ``hybrid`` (several KV cache groups), ``repair`` (failed loads),
``stores`` (the shared store pipeline), ``metrics`` and ``tracing``, ``plugin`` (the
``vllm.general_plugins`` entry point).
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVFabricConnector"]


def __getattr__(name: str) -> Any:
    if name in ("KVFabricConnector", "KVFabricMetadata", "KVFabricStats", "instances"):
        from kvfabric.ucm_layer.connector import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
