"""The ``vllm.general_plugins`` entry point: registers ``KVFabricConnector`` by name and
kvfabric's sparse attention backends in vLLM's attention backend registry.

vLLM calls every general plugin in every process it starts (API server, engine core,
workers), possibly more than once per process; registering twice would raise inside
vLLM's factory, so this is guarded. Nothing is imported when vLLM is absent.

Attention backends (only when vLLM has ``vllm.v1.attention.backends.registry``): the
``CPU_ATTN`` slot is overridden with ``kvfabric.ucm_layer.sparse.vllm.cpu`` (vLLM's own CPU
backend unless a sparse algorithm is configured: its impl is then the stock one), and
``CUSTOM`` names ``kvfabric.ucm_layer.sparse.vllm.cuda`` (``--attention-backend CUSTOM``).
``KVFABRIC_SPARSE_BACKEND=0`` leaves the registry alone. Registration stores class paths
only; the backend modules are imported when vLLM resolves the slot.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("kvfabric.connector")

NAME = "KVFabricConnector"
MODULE = "kvfabric.ucm_layer.connector.connector"
#: registry slot -> the class path registered there
BACKENDS = {
    "CPU_ATTN": "kvfabric.ucm_layer.sparse.vllm.cpu.KVFabricCPUBackend",
    "CUSTOM": "kvfabric.ucm_layer.sparse.vllm.cuda.KVFabricFlashBackend",
}
_lock = threading.Lock()


def register() -> bool:
    """Register the connector (and the attention backends) with vLLM; True if this call
    registered the connector."""
    register_backends()
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


def register_backends() -> list[str]:
    """Point the ``BACKENDS`` slots of vLLM's attention registry at kvfabric's backends;
    the slots this call changed (none if already done, another override holds the slot,
    vLLM lacks the registry, or
    ``KVFABRIC_SPARSE_BACKEND=0``)."""
    from kvfabric.ucm_layer.sparse.vllm.config import KVFABRIC_SPARSE_BACKEND

    if not KVFABRIC_SPARSE_BACKEND.get():
        return []
    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    except ImportError:
        return []
    changed = []
    with _lock:
        for slot, path in BACKENDS.items():
            member = getattr(AttentionBackendEnum, slot, None)
            if member is None:
                continue
            try:
                current = member.get_path()
            except ValueError:  # CUSTOM has no default path
                current = None
            if current == path:
                continue
            if member.is_overridden():  # someone else's override: theirs stands
                log.info("kvfabric: attention slot %s is overridden with %s; not replacing it", slot, current)
                continue
            register_backend(member, path)
            changed.append(slot)
    if changed:
        log.debug("kvfabric: attention backends registered in %s", ", ".join(changed))
    return changed
