"""``PoolConfig``: everything the pool daemon, the embedded pool and clients are told.

Built from keyword arguments, a flat mapping, or a YAML file (``from_file``); every
value is validated on construction with an error naming the key: first its type, from the
field's annotation (``kvfabric.settings``: booleans from ``true/false/on/off/yes/no/1/0``
only, numbers from numbers or their text, ``Size`` fields also from ``"4GiB"`` style
strings; a new field is covered by its annotation), then its range. Unknown keys are
refused with the sorted list of the known ones. ``effective()`` is what the daemon logs
once at start-up.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfabric.settings import Size, coerce_fields, from_mapping


def _host_port(value: str, key: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host:
        raise ValueError(f"pool config {key}={value!r}: expected HOST:PORT")
    try:
        p = int(port)
    except ValueError:
        raise ValueError(f"pool config {key}={value!r}: port {port!r} is not a number") from None
    if not 0 <= p <= 65535:
        raise ValueError(f"pool config {key}={value!r}: port must be 0..65535")
    return host, p


def default_socket(name: str) -> str:
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return str(Path(base) / f"kvfabric-pool-{name}.sock")


@dataclass(frozen=True)
class PoolConfig:
    """Pool daemon / embedded pool configuration (see field comments)."""

    name: str = "default"  # pool name: names the socket and the shared segments
    dram: Size = 1 << 30  # bytes of DRAM the service contributes as its own rank (0: none)
    max_objects: int = 1 << 18  # directory capacity
    high_watermark: float = 0.9  # evict when a window is fuller than this...
    low_watermark: float = 0.8  # ...down to this
    write_lease_s: float = 10.0  # an allocation not committed by then is reclaimed
    read_lease_s: float = 5.0  # a read lease blocks eviction for at most this long
    default_ttl_s: float = 0.0  # 0: objects do not expire
    socket: str = ""  # Unix socket path for RPC ("" -> a per-user default)
    tcp: str = ""  # "HOST:PORT" to also serve RPC over TCP ("" -> off)
    token: str = ""  # shared secret required on TCP connections
    http: str = ""  # "HOST:PORT" of the HTTP endpoint (/health, /metrics, ...; "" -> off)
    align: Size = 256  # allocation granularity in bytes
    rpc_timeout_s: float = 1.0  # clients: a call not answered by then is ServiceUnavailable
    rpc_spin_us: float = 100.0  # daemon: poll a Unix connection this long for a request, then sleep
    pretouch: bool = True  # fault the service's window in at start (first touch is slow)
    rendezvous: str = ""  # "" -> the node hosts one; else a store url (etcd://host:port)
    session_ttl_s: float = 10.0  # a rank silent this long is probed, then dropped if stopped or gone
    transports: str = "mapped"  # GVA transports ranks may use, in order ("mapped,remote")
    verify: str = "on"  # readers check the writer's checksum before a read counts ("on" / "off")
    fence_grace_s: float = 60.0  # expired writes of unwatchable writers stay fenced this long
    exit_when_idle_s: float = 0.0  # daemon: exit after this long with no client (0: serve until told)

    def __post_init__(self) -> None:
        coerce_fields(self, lambda key: f"pool config {key}")
        if not self.name or any(c in self.name for c in "/ \0"):
            raise ValueError(f"pool config name={self.name!r}: a non-empty name without '/' or spaces")
        if self.max_objects < 1:
            raise ValueError("pool config max_objects must be >= 1")
        if self.align & (self.align - 1) or self.align == 0:
            raise ValueError(f"pool config align={self.align}: must be a power of two")
        if not 0 < self.low_watermark < self.high_watermark <= 1:
            raise ValueError(
                f"pool config watermarks: need 0 < low_watermark ({self.low_watermark}) < "
                f"high_watermark ({self.high_watermark}) <= 1"
            )
        for key in ("write_lease_s", "read_lease_s", "rpc_timeout_s", "session_ttl_s"):
            if getattr(self, key) <= 0:
                raise ValueError(f"pool config {key} must be > 0, got {getattr(self, key)}")
        if not 0 <= self.rpc_spin_us <= 10_000:
            raise ValueError(f"pool config rpc_spin_us must be between 0 and 10000, got {self.rpc_spin_us}")
        if self.default_ttl_s < 0:
            raise ValueError(f"pool config default_ttl_s must be >= 0, got {self.default_ttl_s}")
        if self.exit_when_idle_s < 0:
            raise ValueError(f"pool config exit_when_idle_s must be >= 0, got {self.exit_when_idle_s}")
        if self.tcp:
            _host_port(self.tcp, "tcp")
        if self.http:
            _host_port(self.http, "http")
        names = [t.strip() for t in self.transports.split(",") if t.strip()]
        if not names or any(t not in ("mapped", "remote") for t in names):
            raise ValueError(f"pool config transports={self.transports!r}: a list of mapped, remote")
        if self.rendezvous and "://" not in self.rendezvous:
            raise ValueError(
                f"pool config rendezvous={self.rendezvous!r}: expected a url like etcd://HOST:PORT"
            )
        if self.token and not self.tcp:
            raise ValueError("pool config token is only used with tcp; set tcp=HOST:PORT")
        from kvfabric.platform.checksum import Verify

        object.__setattr__(self, "verify", Verify.parse(self.verify, "pool config verify").value)
        if self.fence_grace_s < self.write_lease_s:
            raise ValueError(
                f"pool config fence_grace_s ({self.fence_grace_s}) must be >= "
                f"write_lease_s ({self.write_lease_s})"
            )
        if not self.socket:
            object.__setattr__(self, "socket", default_socket(self.name))

    @property
    def tcp_addr(self) -> tuple[str, int] | None:
        return _host_port(self.tcp, "tcp") if self.tcp else None

    @property
    def http_addr(self) -> tuple[str, int] | None:
        return _host_port(self.http, "http") if self.http else None

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], **overrides: Any) -> PoolConfig:
        return from_mapping(cls, data, "pool config", **overrides)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], **overrides: Any) -> PoolConfig:
        import yaml

        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as e:
            raise ValueError(f"cannot read pool config {path}: {e}") from e
        if not isinstance(data, dict):
            raise ValueError(f"pool config {path} must be a mapping of keys to values")
        return cls.from_mapping(data, **overrides)

    def effective(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if out["token"]:
            out["token"] = "***"
        return out
