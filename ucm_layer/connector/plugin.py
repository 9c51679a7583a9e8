"""The ``vllm.general_plugins`` entry point: registers ``KVFabricConnector`` by name.

vLLM calls every general plugin in every process it starts (API server, engine core,
workers), possibly more than once per process; registering twice would raise inside
vLLM's factory, so this is guarded. Nothing is imported when vLLM is absent.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("kvfabric.connector")

NAME = "KVFabricConnector"
MODULE = "kvfabric.ucm_layer.connector.connector"
_lock = threading.Lock()


def register() -> bool:
    """Register the connector with vLLM's factory; True if this call registered it."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:
        return False
    with _lock:
        known = getattr(KVConnectorFactory, "_registry", None)
        if isinstance(known, dict) and NAME in known:
            return False
        try:
            KVConnectorFactory.register_connector(NAME, MODULE, NAME)
        except ValueError:  # registered meanwhile by another path
            return False
    log.debug("kvfabric: registered %s with vLLM", NAME)
    return True
