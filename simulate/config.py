"""The simulator's inputs: the cluster, its prices, the calibration, the synthetic trace.

All are frozen dataclasses in kvfabric's configuration language (``kvfabric.settings``):
each value is checked by its annotation and its ``setting`` range on construction, a bad
one is a ``ValueError`` naming the key (``sim cluster nodes=0: expected an integer in
[1, 1000000]``), an unknown key is refused with the known ones, and ``describe(cls)`` lists keys,
defaults and meanings. Files are YAML mappings: a cluster file holds the cluster keys
and an optional ``price:`` section (:func:`load_cluster`); a calibration file holds the
calibration keys (:func:`load_calibration`, :func:`save_calibration`).
"""

from __future__ import annotations

import enum
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from kvfabric.settings import Size, coerce_fields, load, read_yaml, setting


class Routing(enum.Enum):
    """How the router picks an engine for a request."""

    ROUND_ROBIN = "round-robin"
    PREFIX_AWARE = "prefix-aware"


class TierName(enum.Enum):
    """The cache tiers, fastest first (the order a lookup walks them in)."""

    HBM = "hbm"
    DRAM = "dram"
    SSD = "ssd"


@dataclass(frozen=True)
class PriceTable:
    """What the cluster costs per hour (any currency; the report says per million tokens)."""

    node_hour: float = setting(0.0, doc="one node (its accelerators and host) per hour", lo=0)
    dram_gib_hour: float = setting(0.0, doc="one GiB of pool DRAM per hour", lo=0)
    ssd_gib_hour: float = setting(0.0, doc="one GiB of SSD per hour", lo=0)

    def __post_init__(self) -> None:
        coerce_fields(self, lambda key: f"sim cluster price.{key}")


@dataclass(frozen=True)
class ClusterConfig:
    """The simulated deployment: nodes, engines, tier capacities, routing, prices."""

    nodes: int = setting(1, doc="nodes in the cluster", lo=1, hi=1_000_000)
    engines_per_node: int = setting(1, doc="inference engines per node (each with its own HBM)", lo=1)
    block_tokens: int = setting(32, doc="tokens per KV block (Mooncake traces: 512)", lo=1)
    kv_bytes_per_token: Size = setting(131072, doc="KV bytes of one token over all layers")
    hbm_bytes: Size = setting(0, doc="HBM per engine for the prefix cache (0: no HBM tier)")
    dram_bytes: Size = setting(64 << 30, doc="pool DRAM per node (0: no DRAM tier)")
    ssd_bytes: Size = setting(0, doc="SSD per node (0: no SSD tier)")
    high_watermark: float = setting(0.9, doc="a tier fuller than this is trimmed...", gt=0, hi=1)
    low_watermark: float = setting(0.8, doc="...down to this (the pool's LruByBytes)", gt=0, hi=1)
    align: Size = setting(256, doc="allocation granularity of a tier (the pool's align)")
    exact_extents: bool = setting(
        False, doc="run each tier's space on the pool's ExtentAllocator (slower; same answers)"
    )
    promote: bool = setting(True, doc="an SSD hit is also stored in the node's DRAM")
    routing: Routing = setting(Routing.PREFIX_AWARE, doc="round-robin or prefix-aware")
    route_slack: int = setting(
        4, doc="prefix-aware: take a less loaded engine when the best match has this many more", lo=0
    )
    seed: int = setting(0, doc="seed of the router's random choices", lo=0)
    price: PriceTable = field(default_factory=PriceTable)

    def __post_init__(self) -> None:
        coerce_fields(self, lambda key: f"sim cluster {key}")
        if not self.low_watermark < self.high_watermark:
            raise ValueError(
                f"sim cluster watermarks: need low_watermark ({self.low_watermark}) < "
                f"high_watermark ({self.high_watermark})"
            )
        if self.align & (self.align - 1) or self.align == 0:
            raise ValueError(f"sim cluster align={self.align}: must be a power of two")
        for key in ("hbm_bytes", "dram_bytes", "ssd_bytes"):
            cap = getattr(self, key)
            if 0 < cap < self.block_bytes:
                raise ValueError(
                    f"sim cluster {key}={cap}: smaller than one block ({self.block_bytes} B); 0 turns it off"
                )
        if not (self.hbm_bytes or self.dram_bytes or self.ssd_bytes):
            raise ValueError("sim cluster: every tier is 0 bytes; give hbm_bytes, dram_bytes or ssd_bytes")

    @property
    def block_bytes(self) -> int:
        return self.block_tokens * self.kv_bytes_per_token

    @property
    def engines(self) -> int:
        return self.nodes * self.engines_per_node

    def with_value(self, key: str, value: Any) -> ClusterConfig:
        """A copy with one key changed (checked like a file's value)."""
        if key not in _CLUSTER_KEYS:
            raise ValueError(f"unknown sim cluster key {key!r}; known: {sorted(_CLUSTER_KEYS)}")
        return replace(self, **{key: value})

    def as_mapping(self) -> dict[str, Any]:
        out = asdict(self)
        out["routing"] = self.routing.value
        return out


_CLUSTER_KEYS = {f for f in ClusterConfig.__dataclass_fields__ if f != "price"}


def load_cluster(
    file: str | os.PathLike[str] | None = None,
    data: Mapping[str, Any] | None = None,
    flags: Iterable[str] = (),
) -> ClusterConfig:
    """A cluster from a YAML ``file``, then ``data``, then ``key=value`` ``flags``
    (``price.node_hour=2.5`` for a price)."""
    merged: dict[str, Any] = read_yaml(file, "sim cluster file") if file is not None else {}
    merged.update(data or {})
    flat = [f for f in flags]
    price_data: dict[str, Any] = dict(merged.pop("price", None) or {})
    rest = []
    for f in flat:
        key, sep, value = str(f).partition("=")
        if sep and key.strip().startswith("price."):
            price_data[key.strip()[len("price.") :]] = value.strip()
        else:
            rest.append(f)
    price = load(PriceTable, price_data, what="sim cluster price")
    return load(ClusterConfig, merged, what="sim cluster", flags=rest, price=price)


@dataclass(frozen=True)
class Calibration:
    """The times the replay charges, measured by ``kvfabric bench`` (``kvfabric sim
    calibrate``) or given for other hardware. Prefill of ``n`` new tokens after ``c``
    cached ones takes ``prefill_base_s + n / prefill_tokens_per_s + prefill_attn_s * n *
    (c + n / 2)``; a load of ``b`` bytes from a tier takes ``b / (<tier>_load_gbps * 1e9)``
    plus ``load_block_s`` per block and ``load_fixed_s`` once per request that loads, and
    a request that asks the pool pays ``lookup_rpc_s`` once."""

    prefill_tokens_per_s: float = setting(doc="prefill throughput of one engine, tokens/s", gt=0)
    decode_tokens_per_s: float = setting(
        doc="decode throughput of one engine (all its requests), tokens/s", gt=0
    )
    dram_load_gbps: float = setting(doc="GB/s of a load from the node's pool DRAM into the engine", gt=0)
    prefill_base_s: float = setting(0.0, doc="fixed time of a request's prefill step and first sample", lo=0)
    prefill_attn_s: float = setting(0.0, doc="attention: seconds per new token per context token", lo=0)
    hbm_load_gbps: float = setting(0.0, doc="HBM hits cost nothing to load (0) or this GB/s", lo=0)
    ssd_load_gbps: float = setting(1.0, doc="GB/s of a load from the node's SSD", gt=0)
    load_block_s: float = setting(0.0, doc="fixed cost per block loaded from DRAM or SSD", lo=0)
    load_fixed_s: float = setting(0.0, doc="fixed cost of a request that loads any block (a step)", lo=0)
    lookup_rpc_s: float = setting(0.0, doc="one pool lookup per request that asks DRAM or SSD", lo=0)
    source: str = setting("", doc="where the figures come from (the bench rows, a paper)")

    def __post_init__(self) -> None:
        coerce_fields(self, lambda key: f"sim calibration {key}")

    def prefill_s(self, new_tokens: int, cached_tokens: int) -> float:
        """Seconds to prefill ``new_tokens`` after ``cached_tokens`` (see the class docstring)."""
        return (
            self.prefill_base_s
            + new_tokens / self.prefill_tokens_per_s
            + self.prefill_attn_s * new_tokens * (cached_tokens + new_tokens / 2)
        )


def load_calibration(
    file: str | os.PathLike[str] | None = None,
    data: Mapping[str, Any] | None = None,
    flags: Iterable[str] = (),
) -> Calibration:
    """A calibration from a YAML ``file``, then ``data``, then ``key=value`` ``flags``."""
    return load(Calibration, data, what="sim calibration", file=file, flags=flags)


def save_calibration(cal: Calibration, path: str | os.PathLike[str]) -> None:
    """Write ``cal`` as the YAML :func:`load_calibration` reads."""
    import yaml

    with open(path, "w") as f:
        yaml.safe_dump(asdict(cal), f, sort_keys=False)


@dataclass(frozen=True)
class SyntheticConfig:
    """A generated trace: requests whose prompts are a system prompt shared by all, one
    of ``prefixes`` shared prefixes picked by Zipf popularity (``zipf_s``; 0: uniform),
    and a suffix of their own. Prefix lengths are drawn once per prefix, suffix and output
    lengths per request, each lognormal with the given mean and sigma (0: constant).
    Arrivals are Poisson at ``qps`` times ``1 + diurnal_swing * sin(2 pi t / period)``."""

    requests: int = setting(10_000, doc="requests in the trace", lo=1)
    qps: float = setting(10.0, doc="mean arrival rate over the cluster, requests/s", gt=0)
    diurnal_swing: float = setting(0.0, doc="relative amplitude of the daily rate swing", lo=0, hi=0.99)
    diurnal_period_s: float = setting(86400.0, doc="period of the swing", gt=0)
    prefixes: int = setting(1000, doc="distinct shared prefixes", lo=1)
    zipf_s: float = setting(1.0, doc="Zipf exponent of prefix popularity (0: uniform)", lo=0)
    system_tokens: int = setting(0, doc="tokens of a system prompt every request starts with", lo=0)
    prefix_tokens_mean: float = setting(2048.0, doc="mean shared prefix length, tokens", gt=0)
    prefix_tokens_sigma: float = setting(0.5, doc="lognormal sigma of prefix lengths", lo=0)
    suffix_tokens_mean: float = setting(256.0, doc="mean unshared suffix length, tokens", gt=0)
    suffix_tokens_sigma: float = setting(0.5, doc="lognormal sigma of suffix lengths", lo=0)
    output_tokens_mean: float = setting(128.0, doc="mean output length, tokens", gt=0)
    output_tokens_sigma: float = setting(0.5, doc="lognormal sigma of output lengths", lo=0)
    max_prompt_tokens: int = setting(131072, doc="prompts are cut to this many tokens", lo=1)
    seed: int = setting(0, doc="random seed", lo=0)

    def __post_init__(self) -> None:
        coerce_fields(self, lambda key: f"sim synthetic {key}")


def load_synthetic(
    file: str | os.PathLike[str] | None = None,
    data: Mapping[str, Any] | None = None,
    flags: Iterable[str] = (),
) -> SyntheticConfig:
    """A synthetic trace's parameters from a YAML ``file``, ``data`` and ``key=value`` flags."""
    return load(SyntheticConfig, data, what="sim synthetic", file=file, flags=flags)


__all__ = [
    "Calibration",
    "ClusterConfig",
    "PriceTable",
    "Routing",
    "SyntheticConfig",
    "TierName",
    "load_calibration",
    "load_cluster",
    "load_synthetic",
    "save_calibration",
]
