"""The connector's configuration: ``kv_connector_extra_config``, optionally a YAML file.

Keys (all optional; a YAML file named by ``config_file`` holds the same keys, and keys
given inline override the file's):

=====================  ====================================================================
``store``              store pipeline, e.g. ``"cache|pool"`` (default when the ``pool``
                       store is registered), ``"cache|posix"`` (default otherwise), ``"posix"``
``pool_address``       the pool daemon: its Unix socket path (``/...``, same node) or
                       ``host:port`` (TCP); ``"auto"``: the node-local daemon the first
                       process starts and the others join (``kvfabric.pool.autostart``);
                       ``"embedded"``: a pool inside the process. Unset: ``embedded`` when
                       the engine is one process (scheduler and worker together), ``auto``
                       when it spans several (vLLM's multiprocessing executor, TP > 1)
``pool_idle_exit_s``   an auto-started daemon exits this long after its last client left
                       (default 30; 0: it stays until SIGTERM)
``posix_path``         directory of the ``posix`` store (default: ``<KVFABRIC_CACHE_DIR>/kv``)
``cache_bytes``        capacity of the ``cache`` tier, e.g. ``"2GiB"``
``pool_bytes``         capacity of an embedded or auto-started pool, e.g. ``"8GiB"``
``store_options``      mapping passed verbatim to the stores (their own keys)
``delegator``          gather a block's pieces into one transfer: ``true``, ``false`` or
                       ``"auto"`` (default: on where the KV cache is device memory, off where
                       it is host memory, as in vLLM's CPU build, where the gather is one more
                       memcpy of every byte and the store's batched copy already gathers)
``staging_blocks``     Delegator staging slots, in blocks (default 128)
``layerwise``          load and dump layer by layer (default false: whole requests)
``sparse``             a sparse decode-attention algorithm of ``kvfabric.ucm_layer.sparse``
                       (``"gsa"``, ``"quest"``, ...; ``true`` means ``"gsa"``; default off).
                       In vLLM, kvfabric's attention backend (``ucm_layer/sparse/vllm``,
                       registered by the plugin) reads it and runs long decodes sparse;
                       its budget and thresholds come from ``additional_config
                       ["kvfabric_sparse"]`` or ``KVFABRIC_SPARSE`` (docs/sparse.md)
``load_timeout_s``     a load not finished by then is a failed load (default 60)
``async_load``         load a request's prefix off the forward's thread: vLLM keeps the
                       request waiting until its blocks are in place while the other
                       requests keep stepping (default ``"auto"``: on, unless ``layerwise``,
                       whose loads overlap the forward layer by layer)
``pd_wait_s``          disaggregated prefill: how long a consumer waits for the blocks a
                       producer announced in ``kv_transfer_params`` to become visible
                       before it computes what is missing (default 30)
``otlp_endpoint``      OpenTelemetry collector URL; spans are exported only when set
                       (``OTEL_EXPORTER_OTLP_ENDPOINT`` also counts)
``platform``           kvfabric platform name (default: detection)
=====================  ====================================================================

The keys are :class:`ConnectorConfig`'s fields in kvfabric's one configuration language
(``kvfabric.settings``: type from the annotation, range and meaning from ``setting``), loaded
by ``settings.load``: validation happens at construction with errors naming the key and
value, an unknown key is refused with the known ones; ``sparse`` takes the names of the
sparse registry (``kvfabric.ucm_layer.sparse.base.ALGORITHMS``, plugins included).
``settings.describe(ConnectorConfig)`` lists keys, defaults and meanings;
``ConnectorConfig.describe()`` is the effective configuration logged once per process.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from kvfabric.envs import KVFABRIC_CACHE_DIR
from kvfabric.settings import Expected, Size, coerce_fields, load, parse_auto_bool, read_yaml, setting

log = logging.getLogger("kvfabric.connector")

_logged: set[str] = set()
AUTO, EMBEDDED = "auto", "embedded"  # pool_address values that name no daemon
POOL_PLACES = (AUTO, EMBEDDED)
_log_lock = threading.Lock()


def sparse_algorithms() -> tuple[str, ...]:
    """The names of the sparse registry (``kvfabric.ucm_layer.sparse.base.ALGORITHMS``:
    built-in, registered and plugin algorithms)."""
    from kvfabric.ucm_layer.sparse.base import ALGORITHMS

    return tuple(ALGORITHMS.names())


def _as_sparse(v: Any) -> str | None:
    """``false`` / ``true`` (``"gsa"``) / an algorithm name of the sparse registry."""
    if (
        v is None
        or v is False
        or (isinstance(v, str) and v.strip().lower() in ("", "0", "false", "off", "no"))
    ):
        return None
    if v is True or (isinstance(v, str) and v.strip().lower() in ("1", "true", "on", "yes")):
        return "gsa"
    names = sparse_algorithms()
    name = v.strip().lower() if isinstance(v, str) else None
    if name not in names:
        raise Expected(f"true/false or one of {', '.join(names)}")
    return name


@dataclass(frozen=True)
class ConnectorConfig:
    """Validated connector settings (see the module docstring for each key)."""

    store: str = setting("", doc="store pipeline, e.g. 'cache|pool' or 'cache|posix'")
    pool_address: str | None = setting(None, doc="pool daemon socket path, host:port, 'auto' or 'embedded'")
    posix_path: str = setting("", doc="directory of the posix store (default: <KVFABRIC_CACHE_DIR>/kv)")
    cache_bytes: Size = setting(1 << 30, doc="capacity of the cache tier")
    pool_bytes: Size = setting(4 << 30, doc="capacity of an embedded or auto-started pool")
    pool_idle_exit_s: float = setting(
        30.0, doc="an auto-started daemon exits this long after its last client", lo=0
    )
    store_options: Mapping[str, Any] = setting(
        default_factory=dict, doc="mapping passed verbatim to the stores"
    )
    delegator: bool | None = setting(
        None, doc="gather a block's pieces into one transfer (None: auto)", parse=parse_auto_bool
    )
    staging_blocks: int = setting(128, doc="Delegator staging slots, in blocks", lo=1)
    layerwise: bool = setting(False, doc="load and dump layer by layer")
    sparse: str | None = setting(
        None, doc="a sparse decode-attention algorithm (true: gsa)", parse=_as_sparse
    )
    load_timeout_s: float = setting(60.0, doc="a load not finished by then is a failed load", gt=0)
    async_load: bool | None = setting(
        None, doc="load a request's prefix off the forward's thread (None: auto)", parse=parse_auto_bool
    )
    pd_wait_s: float = setting(30.0, doc="P/D consumer: how long to wait for announced blocks", lo=0)
    otlp_endpoint: str | None = setting(None, doc="OpenTelemetry collector URL")
    platform: str | None = setting(None, doc="kvfabric platform name (default: detection)")
    config_file: str | None = setting(None, doc="YAML file of these keys (inline keys win)")

    def __post_init__(self) -> None:
        coerce_fields(self, lambda key: f"kvfabric config {key!r}")  # types, ranges, from the settings
        if not self.store.strip():
            raise ValueError("kvfabric config 'store' must be a pipeline like 'cache|posix'")
        names = [s.strip() for s in self.store.split("|")]
        if any(not n or not n.replace("_", "").isalnum() for n in names):
            raise ValueError(f"kvfabric config 'store' {self.store!r} is not a pipeline like 'cache|posix'")
        object.__setattr__(self, "store", "|".join(names))
        if self.pool_address is not None and not (
            self.pool_address.startswith("/") or self.pool_address in POOL_PLACES
        ):
            host, sep, port = self.pool_address.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(
                    "kvfabric config 'pool_address' must be a socket path ('/...'), 'host:port', "
                    f"'auto' or 'embedded', got {self.pool_address!r}"
                )

    def resolved(self, kv_on_host: bool) -> ConnectorConfig:
        """This config with ``delegator`` and ``async_load`` decided: the Delegator's
        ``auto`` is on unless the KV cache is host memory; ``async_load``'s is on unless
        loads are layer-wise. The switch is not part of the block ids: on or off, a store keeps a block's
        pieces in the same order (see docs/hashing.md), so blocks dumped one way load the
        other way."""
        out = self if self.async_load is not None else replace(self, async_load=not self.layerwise)
        if out.delegator is not None:
            return out
        return replace(out, delegator=not kv_on_host)

    def placed(self, one_process: bool) -> ConnectorConfig:
        """This config with an unset ``pool_address`` decided: ``embedded`` when the engine
        is one process, else ``auto`` (one node-local daemon for all its processes). Also
        unchanged when ``store_options`` names a daemon itself (``pool.socket`` / ``pool.tcp``)."""
        if self.pool_address is not None or "pool" not in self.stores:
            return self
        if any(self.store_options.get(k) for k in ("pool.socket", "pool.tcp")):
            return self
        return replace(self, pool_address=EMBEDDED if one_process else AUTO)

    @property
    def pool_name(self) -> str:
        return str(self.store_options.get("pool.name") or "default")

    @property
    def stores(self) -> tuple[str, ...]:
        return tuple(self.store.split("|"))

    def describe(self) -> str:
        d = asdict(self)
        d["store_options"] = dict(self.store_options)
        return ", ".join(f"{k}={v!r}" for k, v in d.items())

    def log_once(self, role: str) -> None:
        """Log the effective configuration once per process and role."""
        text = self.describe()
        with _log_lock:
            if (role, text) in _logged:
                return
            _logged.add((role, text))  # type: ignore[arg-type]
        log.info("kvfabric connector (%s) effective config: %s", role, text)


def _read_yaml(path: str) -> dict[str, Any]:
    """The keys of a ``config_file``: the whole file, or its ``kvfabric:`` section."""
    data = read_yaml(path, "kvfabric config_file")
    if "kvfabric" in data and isinstance(data["kvfabric"], dict):
        data = data["kvfabric"]
    if "config_file" in data:
        raise ValueError(f"kvfabric config_file {path!r} may not name another config_file")
    return data


def default_store() -> str:
    from kvfabric.ucm_layer.connector.stores import registered_stores

    return "cache|pool" if "pool" in registered_stores() else "cache|posix"


def load_config(extra: Mapping[str, Any] | None) -> ConnectorConfig:
    """Build the config from ``kv_connector_extra_config`` (and the YAML file it names)."""
    if extra is not None and not isinstance(extra, Mapping):
        raise TypeError(f"kv_connector_extra_config must be a mapping, got {type(extra).__name__}")
    merged: dict[str, Any] = {}
    inline = dict(extra or {})
    file = inline.get("config_file")
    if file:
        merged.update(_read_yaml(str(file)))
    merged.update(inline)
    merged.setdefault("store", default_store())
    if not merged.get("posix_path"):
        merged["posix_path"] = os.path.join(KVFABRIC_CACHE_DIR.get(), "kv")
    if not merged.get("otlp_endpoint"):
        merged["otlp_endpoint"] = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None
    return load(ConnectorConfig, merged, what="kvfabric config")
