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
                       vLLM does not call sparse-attention hooks without engine patches, so
                       in vLLM it only logs that decode attention stays dense; engines that
                       call the ``UcmSparseBase`` hooks build the algorithm by this name
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

Validation happens at construction with errors naming the key; ``describe()`` is the
effective configuration logged once per process.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from kvfabric.envs import KVFABRIC_CACHE_DIR, parse_size
from kvfabric.settings import coerce_fields

log = logging.getLogger("kvfabric.connector")

_logged: set[str] = set()
AUTO, EMBEDDED = "auto", "embedded"  # pool_address values that name no daemon
POOL_PLACES = (AUTO, EMBEDDED)
_log_lock = threading.Lock()


@dataclass(frozen=True)
class ConnectorConfig:
    """Validated connector settings (see the module docstring for each key)."""

    store: str = ""
    pool_address: str | None = None
    posix_path: str = ""
    cache_bytes: int = 1 << 30
    pool_bytes: int = 4 << 30
    pool_idle_exit_s: float = 30.0
    store_options: Mapping[str, Any] = field(default_factory=dict)
    delegator: bool | None = None  # None: auto (see resolved())
    staging_blocks: int = 128
    layerwise: bool = False
    sparse: str | None = None
    load_timeout_s: float = 60.0
    async_load: bool | None = None  # None: auto (see resolved())
    pd_wait_s: float = 30.0
    otlp_endpoint: str | None = None
    platform: str | None = None
    config_file: str | None = None

    def __post_init__(self) -> None:
        coerce_fields(self, lambda key: f"kvfabric config {key!r}")  # types, from the annotations
        if not isinstance(self.store, str) or not self.store.strip():
            raise ValueError("kvfabric config 'store' must be a pipeline like 'cache|posix'")
        names = [s.strip() for s in self.store.split("|")]
        if any(not n or not n.replace("_", "").isalnum() for n in names):
            raise ValueError(f"kvfabric config 'store' {self.store!r} is not a pipeline like 'cache|posix'")
        object.__setattr__(self, "store", "|".join(names))
        if self.pool_address is not None and not (
            str(self.pool_address).startswith("/") or self.pool_address in POOL_PLACES
        ):
            host, sep, port = str(self.pool_address).rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(
                    "kvfabric config 'pool_address' must be a socket path ('/...'), 'host:port', "
                    f"'auto' or 'embedded', got {self.pool_address!r}"
                )
        if self.pool_idle_exit_s < 0:
            raise ValueError(f"kvfabric config 'pool_idle_exit_s' must be >= 0, got {self.pool_idle_exit_s}")
        if self.staging_blocks < 1:
            raise ValueError(f"kvfabric config 'staging_blocks' must be >= 1, got {self.staging_blocks}")
        if self.load_timeout_s <= 0:
            raise ValueError(f"kvfabric config 'load_timeout_s' must be > 0, got {self.load_timeout_s}")
        if self.pd_wait_s < 0:
            raise ValueError(f"kvfabric config 'pd_wait_s' must be >= 0, got {self.pd_wait_s}")
        if not isinstance(self.store_options, Mapping):
            raise TypeError("kvfabric config 'store_options' must be a mapping")

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


_BOOL = {
    "true": True,
    "1": True,
    "yes": True,
    "on": True,
    "false": False,
    "0": False,
    "no": False,
    "off": False,
}


def _as_bool(key: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lower() in _BOOL:
        return _BOOL[v.strip().lower()]
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    raise ValueError(f"kvfabric config {key!r} must be a boolean, got {v!r}")


def _as_auto_bool(key: str, v: Any) -> bool | None:
    """A boolean, or ``None`` for ``"auto"`` (decided later from the engine)."""
    if v is None or (isinstance(v, str) and v.strip().lower() == "auto"):
        return None
    try:
        return _as_bool(key, v)
    except ValueError:
        raise ValueError(f"kvfabric config {key!r} must be a boolean or 'auto', got {v!r}") from None


def _as_int(key: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, str)):
        raise ValueError(f"kvfabric config {key!r} must be an integer, got {v!r}")
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"kvfabric config {key!r} must be an integer, got {v!r}") from None


def _as_size(key: str, v: Any) -> int:
    try:
        return parse_size(v)
    except (TypeError, ValueError) as e:
        raise ValueError(f"kvfabric config {key!r}: {e}") from e


def _as_float(key: str, v: Any) -> float:
    if isinstance(v, bool):
        raise ValueError(f"kvfabric config {key!r} must be a number, got {v!r}")
    try:
        return float(v)
    except (TypeError, ValueError):
        raise ValueError(f"kvfabric config {key!r} must be a number, got {v!r}") from None


SPARSE_ALGORITHMS = ("gsa", "quest", "meankey", "hata", "oracle", "dense")


def _as_sparse(key: str, v: Any) -> str | None:
    """``false`` / ``true`` / an algorithm name (the sparse registry's built-in names)."""
    if (
        v is None
        or v is False
        or (isinstance(v, str) and v.strip().lower() in ("", "0", "false", "off", "no"))
    ):
        return None
    if v is True or (isinstance(v, str) and v.strip().lower() in ("1", "true", "on", "yes")):
        return "gsa"
    name = str(v).strip().lower()
    if name not in SPARSE_ALGORITHMS:
        raise ValueError(
            f"kvfabric config {key!r} must be true/false or one of {', '.join(SPARSE_ALGORITHMS)}, got {v!r}"
        )
    return name


_PARSERS = {
    "delegator": _as_auto_bool,
    "async_load": _as_auto_bool,
    "pd_wait_s": _as_float,
    "layerwise": _as_bool,
    "sparse": _as_sparse,
    "staging_blocks": _as_int,
    "cache_bytes": _as_size,
    "pool_bytes": _as_size,
    "load_timeout_s": _as_float,
    "pool_idle_exit_s": _as_float,
}


def _read_yaml(path: str) -> dict[str, Any]:
    import yaml

    p = Path(path).expanduser()
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as e:
        raise ValueError(f"kvfabric config_file {str(p)!r} cannot be read: {e}") from e
    except yaml.YAMLError as e:
        raise ValueError(f"kvfabric config_file {str(p)!r} is not valid YAML: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(
            f"kvfabric config_file {str(p)!r} must hold a mapping of keys, got {type(data).__name__}"
        )
    if "kvfabric" in data and isinstance(data["kvfabric"], dict):
        data = data["kvfabric"]
    if "config_file" in data:
        raise ValueError(f"kvfabric config_file {str(p)!r} may not name another config_file")
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
    known = {f.name for f in fields(ConnectorConfig)}
    unknown = sorted(set(merged) - known)
    if unknown:
        raise ValueError(f"unknown kvfabric config key(s) {unknown}; known keys: {sorted(known)}")
    kwargs: dict[str, Any] = {}
    for k, v in merged.items():
        kwargs[k] = _PARSERS[k](k, v) if k in _PARSERS else v
    kwargs.setdefault("store", default_store())
    if not kwargs.get("posix_path"):
        kwargs["posix_path"] = os.path.join(KVFABRIC_CACHE_DIR.get(), "kv")
    if not kwargs.get("otlp_endpoint"):
        kwargs["otlp_endpoint"] = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None
    try:
        return ConnectorConfig(**kwargs)
    except TypeError as e:
        raise ValueError(f"bad kvfabric config: {e}") from e
