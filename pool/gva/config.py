"""``GvaConfig``: the configuration of one process's view of a GVA pool.

Transports are chosen per (source rank, destination rank) pair: the first
:class:`PairRule` that matches the pair gives the allowed transports in order (the
allow-list); with no matching rule, ``transports`` applies. Among the allowed ones, the
first that can serve the pair from this process is used (``mapped`` needs both ends
addressable here; ``remote`` needs one end here and the other rank to publish a route).
A local buffer counts as this process's own rank for rule matching.

Every field is checked against its annotation first (``kvfabric.settings``), so a wrong
type names the field and what was expected; :meth:`GvaConfig.from_mapping` also refuses
unknown keys with the sorted list of the known ones.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from kvfabric.envs import MC_TCP_BIND_ADDRESS
from kvfabric.settings import coerce_fields, from_mapping

KNOWN_TRANSPORTS = ("mapped", "remote")


@dataclass(frozen=True)
class PairRule:
    """Transports allowed from ``src`` to ``dst`` (ranks; ``None`` matches any rank)."""

    src: int | None
    dst: int | None
    transports: tuple[str, ...]

    def __post_init__(self) -> None:
        coerce_fields(self, lambda key: f"PairRule.{key}")
        for name in ("src", "dst"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"PairRule.{name} must be a rank >= 0 or None, got {v!r}")
        _check_transports(self.transports, "PairRule.transports")

    def matches(self, src: int, dst: int) -> bool:
        return (self.src is None or self.src == src) and (self.dst is None or self.dst == dst)


def _check_transports(names: tuple[str, ...], what: str) -> None:
    if not isinstance(names, tuple) or not names:
        raise ValueError(f"{what} must be a non-empty tuple of transport names, got {names!r}")
    for n in names:
        if n not in KNOWN_TRANSPORTS:
            raise ValueError(f"{what}: unknown transport {n!r}; known: {', '.join(KNOWN_TRANSPORTS)}")


def default_node() -> str:
    """This machine's identity: host name and kernel boot id (same node = same kernel)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()[:8]
    except OSError:
        boot = "noboot"
    return f"{socket.gethostname()}/{boot}"


@dataclass(frozen=True)
class GvaConfig:
    """How this process joins a pool and moves bytes.

    ``namespace``: key prefix of the pool in the rendezvous store (several pools may share
    one store). ``node``: ranks with equal node ids map each other's windows (default:
    host name + boot id). ``alignment``: every GVA offset, local address and size of a
    copy must be a multiple of it (1: no constraint). ``dram_stride`` / ``hbm_stride``:
    pin the strides (0: derived from the largest window; pinning keeps addresses stable
    when a larger window joins later). ``remote_host``: the address the remote engine
    advertises (``MC_TCP_BIND_ADDRESS`` when set, else 127.0.0.1). ``heartbeat_ttl``:
    seconds after which a silent rank is removed (etcd lease TTL). ``unmap_grace``:
    seconds a departed rank's window stays mapped here (spans from ``resolve`` stay
    readable that long). ``extra``: backend-specific keys (e.g. ``mooncake_protocol``).
    """

    namespace: str = "kvfabric/gva/default"
    node: str = field(default_factory=default_node)
    transports: tuple[str, ...] = ("mapped",)
    pair_rules: tuple[PairRule, ...] = ()
    alignment: int = 1
    dram_stride: int = 0
    hbm_stride: int = 0
    remote_engine: str = "mooncake"
    remote_host: str = field(default_factory=lambda: MC_TCP_BIND_ADDRESS.get() or "127.0.0.1")
    copy_streams: int = 1
    join_timeout: float = 30.0
    heartbeat_ttl: float = 10.0  # etcd cannot ask a starved process whether it lives: roomy
    unmap_grace: float = 5.0
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        coerce_fields(self, lambda key: f"GvaConfig.{key}")
        if not isinstance(self.namespace, str) or not self.namespace.strip("/"):
            raise ValueError(f"GvaConfig.namespace must be a non-empty str, got {self.namespace!r}")
        object.__setattr__(self, "namespace", self.namespace.rstrip("/"))
        if not isinstance(self.node, str) or not self.node:
            raise ValueError(f"GvaConfig.node must be a non-empty str, got {self.node!r}")
        object.__setattr__(self, "transports", tuple(self.transports))
        _check_transports(self.transports, "GvaConfig.transports")
        object.__setattr__(self, "pair_rules", tuple(self.pair_rules))
        for r in self.pair_rules:
            if not isinstance(r, PairRule):
                raise TypeError(f"GvaConfig.pair_rules holds PairRule objects, got {type(r).__name__}")
        a = self.alignment
        if isinstance(a, bool) or not isinstance(a, int) or a < 1 or a & (a - 1):
            raise ValueError(f"GvaConfig.alignment must be a power of two >= 1, got {a!r}")
        for name in ("dram_stride", "hbm_stride"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"GvaConfig.{name} must be an int >= 0, got {v!r}")
        if self.copy_streams < 1:
            raise ValueError(f"GvaConfig.copy_streams must be >= 1, got {self.copy_streams}")
        for name in ("join_timeout", "heartbeat_ttl", "unmap_grace"):
            if getattr(self, name) <= 0 if name != "unmap_grace" else getattr(self, name) < 0:
                raise ValueError(f"GvaConfig.{name} must be positive, got {getattr(self, name)}")
        object.__setattr__(self, "extra", MappingProxyType(dict(self.extra)))

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> GvaConfig:
        """A config from a mapping (a parsed YAML or JSON document); unknown keys refused."""
        return from_mapping(cls, data, "GvaConfig")

    def allowed(self, src: int, dst: int) -> tuple[str, ...]:
        """The transports allowed, in order, from rank ``src`` to rank ``dst``."""
        for r in self.pair_rules:
            if r.matches(src, dst):
                return r.transports
        return self.transports
