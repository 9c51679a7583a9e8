"""``PoolConfig``: everything the pool daemon, the embedded pool and clients are told.

Written in kvfabric's one configuration language (``kvfabric.settings``): built from
keyword arguments, a mapping (``from_mapping``), a YAML file (``from_file``) or
``key=value`` flags (``from_flags``, ``kvfabric pool serve --set``); every value is
validated on construction with an error naming the key: first its type, from the field's
annotation (booleans from ``true/false/on/off/yes/no/1/0`` only, numbers from numbers or
their text, ``Size`` fields also from ``"4GiB"`` style strings; a new field is covered by
its annotation), then its range from the field's ``setting`` metadata, then the rules
between keys below. Unknown keys are refused with the sorted list of the known ones.
``describe(PoolConfig)`` lists the keys, defaults and meanings; ``effective()`` is what
the daemon logs once at start-up.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfabric.settings import Expected, Size, coerce_fields, load, setting


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


def _verify(value: Any) -> str:
    from kvfabric.platform.checksum import Verify

    try:
        return Verify.parse(value).value
    except ValueError:
        raise Expected(f"one of {', '.join(v.value for v in Verify)}") from None


def _endpoint(value: str, key: str) -> None:
    """A ZMQ address the daemon binds: ``tcp://HOST:PORT`` (``*`` for every address, port 0
    for a free one), ``ipc://PATH`` or ``inproc://NAME``."""
    scheme, sep, rest = value.partition("://")
    if not sep or scheme not in ("tcp", "ipc", "inproc") or not rest:
        raise ValueError(
            f"pool config {key}={value!r}: expected tcp://HOST:PORT, ipc://PATH or inproc://NAME"
        )
    if scheme == "tcp":
        try:
            _host_port(rest, key)
        except ValueError as e:
            raise ValueError(f"pool config {key}={value!r}: {str(e).split(': ', 1)[1]}") from None


def _check_kv_events(cfg: PoolConfig) -> None:
    """The ``kv_events_*`` keys together (``pool/service/events.py``)."""
    if cfg.kv_events_endpoint:
        _endpoint(cfg.kv_events_endpoint, "kv_events_endpoint")
    if cfg.kv_events_replay_endpoint:
        if not cfg.kv_events_endpoint:
            raise ValueError(
                "pool config kv_events_replay_endpoint needs kv_events_endpoint (the PUB address)"
            )
        _endpoint(cfg.kv_events_replay_endpoint, "kv_events_replay_endpoint")
        same = cfg.kv_events_replay_endpoint == cfg.kv_events_endpoint
        if same and not cfg.kv_events_endpoint.endswith(":0"):
            raise ValueError(
                f"pool config kv_events_replay_endpoint={cfg.kv_events_replay_endpoint!r} is "
                "kv_events_endpoint: the replay socket needs an address of its own"
            )


@dataclass(frozen=True)
class PoolConfig:
    """Pool daemon / embedded pool configuration (each key's ``doc``; ``describe(PoolConfig)``)."""

    name: str = setting("default", doc="pool name: names the socket and the shared segments")
    dram: Size = setting(1 << 30, doc="bytes of DRAM the service contributes as its own rank (0: none)")
    max_objects: int = setting(1 << 18, doc="directory capacity", lo=1)
    high_watermark: float = setting(0.9, doc="evict when a window is fuller than this...", hi=1)
    low_watermark: float = setting(0.8, doc="...down to this", gt=0)
    write_lease_s: float = setting(10.0, doc="an allocation not committed by then is reclaimed", gt=0)
    read_lease_s: float = setting(5.0, doc="a read lease blocks eviction for at most this long", gt=0)
    default_ttl_s: float = setting(0.0, doc="0: objects do not expire", lo=0)
    socket: str = setting("", doc="Unix socket path for RPC ('' -> a per-user default)")
    tcp: str = setting("", doc="HOST:PORT to also serve RPC over TCP ('' -> off)")
    token: str = setting("", doc="shared secret required on TCP connections (RPC and rendezvous)")
    insecure: bool = setting(
        False, doc="serve tcp without a token: no authentication at all (trusted networks only)"
    )
    http: str = setting("", doc="HOST:PORT of the HTTP endpoint (/health, /metrics, ...; '' -> off)")
    align: Size = setting(256, doc="allocation granularity in bytes (a power of two)")
    rpc_timeout_s: float = setting(
        1.0, doc="clients: a call not answered by then is ServiceUnavailable", gt=0
    )
    rpc_spin_us: float = setting(
        100.0, doc="daemon: poll a Unix connection this long for a request, then sleep", lo=0, hi=10_000
    )
    pretouch: bool = setting(True, doc="fault the service's window in at start (first touch is slow)")
    hugepages: str = setting(
        "",
        doc="pages of the service's window: auto, on, off, thp, hugetlb ('' -> the platform's)",
        choices=("", "auto", "on", "off", "thp", "hugetlb"),
    )
    rendezvous: str = setting("", doc="'' -> the node hosts one; else a store url (etcd://host:port)")
    session_ttl_s: float = setting(
        10.0, doc="a rank silent this long is probed, then dropped if stopped or gone", gt=0
    )
    transports: str = setting("mapped", doc="GVA transports ranks may use, in order ('mapped,remote')")
    verify: str = setting(
        "on", doc="readers check the writer's checksum before a read counts (on / off)", parse=_verify
    )
    fence_grace_s: float = setting(60.0, doc="expired writes of unwatchable writers stay fenced this long")
    replicas: int = setting(
        1,
        doc="copies of each object, on distinct nodes (then distinct ranks); a put may ask its own",
        lo=1,
        hi=8,
    )
    replica_sync_s: float = setting(
        1.0,
        doc="clients with a window fetch the list of extents it holds this often (re-registered "
        "with a new leader; 0: never, only their own puts)",
        lo=0,
    )
    remote_read_timeout_s: float = setting(
        1.0,
        doc="clients: a synchronous read from another node's window not finished by then is a miss "
        "(0: no bound; GvaConfig.remote_read_timeout)",
        lo=0,
        hi=3600,
    )
    remote_suspect_s: float = setting(
        5.0,
        doc="clients: copies to a node whose read timed out or whose copy failed fail at once this "
        "long (GvaConfig.remote_suspect_time)",
        lo=0,
        hi=3600,
    )
    kv_events_endpoint: str = setting(
        "", doc="ZMQ PUB address of KV events in vLLM's schema (tcp://*:5557; port 0: any; '' -> off)"
    )
    kv_events_replay_endpoint: str = setting(
        "", doc="ZMQ ROUTER address replaying the last kv_events_buffer batches ('' -> none)"
    )
    kv_events_buffer: int = setting(4096, doc="KV event batches kept for replay", lo=1, hi=1_000_000)
    kv_events_topic: str = setting("", doc="the topic frame of every KV event batch")
    kv_events_queue: int = setting(
        1_000_000, doc="keys waiting for the KV event publisher before it drops and resyncs", lo=1
    )
    exit_when_idle_s: float = setting(
        0.0, doc="daemon: exit after this long with no client (0: serve until told)", lo=0
    )
    leader_election: bool = setting(
        False, doc="campaign for the pool's leadership in the rendezvous etcd (needs tcp); standby till won"
    )
    leader_ttl_s: int = setting(
        10,
        doc="the leader's etcd lease: a leader silent this long is replaced (and stops granting)",
        lo=1,
        hi=3600,
    )
    tcp_advertise: str = setting("", doc="HOST:PORT other nodes reach this daemon's tcp at ('' -> tcp's)")
    etcd_ca: str = setting("", doc="etcd: CA file (PEM) to check its certificate against (HTTPS)")
    etcd_cert: str = setting("", doc="etcd: client certificate file (PEM), with etcd_key")
    etcd_key: str = setting("", doc="etcd: the client certificate's key file (PEM)")
    etcd_user: str = setting("", doc="etcd: user name of its role-based auth, with etcd_password")
    etcd_password: str = setting("", doc="etcd: the user's password")

    def __post_init__(self) -> None:
        coerce_fields(self, lambda key: f"pool config {key}")
        if not self.name or any(c in self.name for c in "/ \0"):
            raise ValueError(f"pool config name={self.name!r}: a non-empty name without '/' or spaces")
        if self.align & (self.align - 1) or self.align == 0:
            raise ValueError(f"pool config align={self.align}: must be a power of two")
        if not self.low_watermark < self.high_watermark:
            raise ValueError(
                f"pool config watermarks: need 0 < low_watermark ({self.low_watermark}) < "
                f"high_watermark ({self.high_watermark}) <= 1"
            )
        if self.tcp:
            _host_port(self.tcp, "tcp")
        if self.http:
            _host_port(self.http, "http")
        _check_kv_events(self)
        names = [t.strip() for t in self.transports.split(",") if t.strip()]
        if not names or any(t not in ("mapped", "remote") for t in names):
            raise ValueError(f"pool config transports={self.transports!r}: a list of mapped, remote")
        if self.rendezvous and "://" not in self.rendezvous:
            raise ValueError(
                f"pool config rendezvous={self.rendezvous!r}: expected a url like etcd://HOST:PORT"
            )
        if self.token and not self.tcp:
            raise ValueError("pool config token is only used with tcp; set tcp=HOST:PORT")
        if self.tcp and not self.token and not self.insecure:
            raise ValueError(
                f"pool config tcp={self.tcp!r} without token: a TCP listener needs a shared secret "
                "(token: SECRET) or, to serve without authentication, insecure: true"
            )
        self._check_cluster()
        if self.fence_grace_s < self.write_lease_s:
            raise ValueError(
                f"pool config fence_grace_s ({self.fence_grace_s}) must be >= "
                f"write_lease_s ({self.write_lease_s})"
            )
        if not self.socket:
            object.__setattr__(self, "socket", default_socket(self.name))

    def _check_cluster(self) -> None:
        """The keys of leadership and etcd security, together."""
        etcd = self.rendezvous.startswith("etcd://")
        if self.leader_election and not (etcd and self.tcp):
            raise ValueError(
                "pool config leader_election needs rendezvous=etcd://HOST:PORT (where the leader is elected) "
                f"and tcp=HOST:PORT (where clients reach the leader); got rendezvous={self.rendezvous!r}, "
                f"tcp={self.tcp!r}"
            )
        if self.tcp_advertise:
            _host, port = _host_port(self.tcp_advertise, "tcp_advertise")
            if not self.tcp or port == 0:
                raise ValueError(f"pool config tcp_advertise={self.tcp_advertise!r}: needs tcp, a port > 0")
        elif self.leader_election and self.tcp_addr is not None and self.tcp_addr[0] in ("0.0.0.0", "::", ""):
            raise ValueError(
                f"pool config tcp={self.tcp!r} listens on every address: set tcp_advertise=HOST:PORT, "
                "the address other nodes reach it at (the leader key holds it)"
            )
        given = [
            k for k in ("etcd_ca", "etcd_cert", "etcd_key", "etcd_user", "etcd_password") if getattr(self, k)
        ]
        if given and not etcd:
            raise ValueError(f"pool config {', '.join(given)}: only used with rendezvous=etcd://HOST:PORT")
        if bool(self.etcd_cert) != bool(self.etcd_key):
            raise ValueError(
                "pool config etcd_cert and etcd_key go together (a client certificate and its key)"
            )
        if bool(self.etcd_user) != bool(self.etcd_password):
            raise ValueError("pool config etcd_user and etcd_password go together")
        for k in ("etcd_ca", "etcd_cert", "etcd_key"):
            path = getattr(self, k)
            if path and not os.path.isfile(path):
                raise ValueError(f"pool config {k}={path!r}: no such file")

    @property
    def etcd_auth(self) -> Any:
        """The etcd TLS / auth settings as an ``EtcdAuth`` (``rendezvous.etcd``)."""
        from kvfabric.pool.gva.rendezvous.etcd import EtcdAuth

        return EtcdAuth(self.etcd_ca, self.etcd_cert, self.etcd_key, self.etcd_user, self.etcd_password)

    @property
    def advertised(self) -> str:
        """HOST:PORT other nodes are told (the leader key); a port 0 is the bound one's to fill."""
        return self.tcp_advertise or self.tcp

    @property
    def tcp_addr(self) -> tuple[str, int] | None:
        return _host_port(self.tcp, "tcp") if self.tcp else None

    @property
    def http_addr(self) -> tuple[str, int] | None:
        return _host_port(self.http, "http") if self.http else None

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], **overrides: Any) -> PoolConfig:
        return load(cls, data, what="pool config", **overrides)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], **overrides: Any) -> PoolConfig:
        return load(cls, None, what="pool config", file=path, **overrides)

    @classmethod
    def from_flags(cls, flags: Iterable[str], **overrides: Any) -> PoolConfig:
        """From ``key=value`` strings (``kvfabric pool serve --set KEY=VALUE``)."""
        return load(cls, None, what="pool config", flags=flags, **overrides)

    def effective(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for secret in ("token", "etcd_password"):
            if out[secret]:
                out[secret] = "***"
        return out
