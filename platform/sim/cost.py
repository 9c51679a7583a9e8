"""The sim platform's cost model: what a copy would take on real hardware.

Each direction has a bandwidth and a per-submission latency; a batched copy pays one
submission latency plus a small per-piece descriptor cost, which is why batching wins on
real devices. The presets are rounded public figures (vendor datasheets and commonly
reported ``memcpy`` measurements), not measurements of this project:

* ``ascend-a2`` (Atlas 800T A2, Ascend 910B): HBM2e ~1.6 TB/s (a device copy reads and
  writes, so ~0.8 TB/s of copy), host link PCIe 5.0 x16 at ~24 GB/s per direction as
  reported for pinned ``aclrtMemcpyAsync``.
* ``ascend-a3`` (Ascend 910C): ~3.2 TB/s HBM, ~48 GB/s host link.
* ``cuda-h100`` (H100 SXM5): HBM3 3.35 TB/s (~1.5 TB/s of device copy), PCIe 5.0 x16 at
  ~55 GB/s pinned.
* ``cuda-a100`` (A100 80GB SXM4): HBM2e 2.0 TB/s (~0.8 TB/s of copy), PCIe 4.0 ~25 GB/s.

Any figure can be overridden (``CostModel.preset("ascend-a2").with_link(...)``).
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass

from kvfabric.platform.types import Direction


@dataclass(frozen=True)
class LinkCost:
    """Bandwidth (GB/s, 1e9 B/s) and submission latency (µs) of one copy direction."""

    gbps: float
    latency_us: float

    def __post_init__(self) -> None:
        if self.gbps <= 0 or self.latency_us < 0:
            raise ValueError(f"bad link cost: gbps={self.gbps} (> 0), latency_us={self.latency_us} (>= 0)")

    def seconds(self, nbytes: int) -> float:
        return self.latency_us * 1e-6 + nbytes / (self.gbps * 1e9)


@dataclass(frozen=True)
class CostModel:
    name: str
    h2h: LinkCost
    h2d: LinkCost
    d2h: LinkCost
    d2d: LinkCost
    batch_piece_us: float = 0.05  # descriptor cost per piece inside one batched submission

    def link(self, direction: Direction) -> LinkCost:
        return (self.h2h, self.h2d, self.d2h, self.d2d)[int(direction)]

    def copy_seconds(self, direction: Direction, nbytes: int) -> float:
        return self.link(direction).seconds(nbytes)

    def batch_seconds(self, bytes_by_direction: dict[Direction, int], pieces: int) -> float:
        """One submission: the largest latency of the directions involved, the bytes of
        each direction at its bandwidth, and the per-piece descriptor cost."""
        if not bytes_by_direction:
            return 0.0
        if len(bytes_by_direction) == 1:
            ((d, n),) = bytes_by_direction.items()
            link = self.link(d)
            return link.latency_us * 1e-6 + n / (link.gbps * 1e9) + pieces * self.batch_piece_us * 1e-6
        lat = max(self.link(d).latency_us for d in bytes_by_direction) * 1e-6
        xfer = sum(n / (self.link(d).gbps * 1e9) for d, n in bytes_by_direction.items())
        return lat + xfer + pieces * self.batch_piece_us * 1e-6

    def with_link(
        self, direction: Direction, gbps: float | None = None, latency_us: float | None = None
    ) -> CostModel:
        old = self.link(direction)
        new = LinkCost(
            old.gbps if gbps is None else gbps, old.latency_us if latency_us is None else latency_us
        )
        return dataclasses.replace(self, **{direction.name.lower(): new})

    @classmethod
    def preset(cls, name: str) -> CostModel:
        try:
            return PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown cost model {name!r}; presets: {', '.join(sorted(PRESETS))}") from None


def _model(name: str, h2h: float, host_link: float, d2d: float, host_lat: float, dev_lat: float) -> CostModel:
    return CostModel(
        name,
        LinkCost(h2h, 1.0),
        LinkCost(host_link, host_lat),
        LinkCost(host_link, host_lat),
        LinkCost(d2d, dev_lat),
    )


PRESETS: dict[str, CostModel] = {
    "ascend-a2": _model("ascend-a2", h2h=10.0, host_link=24.0, d2d=800.0, host_lat=15.0, dev_lat=8.0),
    "ascend-a3": _model("ascend-a3", h2h=10.0, host_link=48.0, d2d=1600.0, host_lat=12.0, dev_lat=6.0),
    "cuda-h100": _model("cuda-h100", h2h=10.0, host_link=55.0, d2d=1500.0, host_lat=6.0, dev_lat=4.0),
    "cuda-a100": _model("cuda-a100", h2h=10.0, host_link=25.0, d2d=800.0, host_lat=8.0, dev_lat=5.0),
}
DEFAULT_MODEL = "ascend-a2"


@dataclass(frozen=True)
class DirectionTotals:
    """Copies of one direction so far: submissions, bytes, wall and simulated seconds."""

    direction: Direction
    copies: int
    nbytes: int
    wall_s: float
    sim_s: float

    @property
    def wall_gbps(self) -> float:
        return self.nbytes / self.wall_s / 1e9 if self.wall_s > 0 else 0.0

    @property
    def sim_gbps(self) -> float:
        return self.nbytes / self.sim_s / 1e9 if self.sim_s > 0 else 0.0


class CostLedger:
    """Thread-safe running totals of wall vs simulated copy time per direction."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rows: dict[Direction, list[float]] = {}

    def add(self, direction: Direction, nbytes: int, wall_s: float, sim_s: float) -> None:
        with self._lock:
            row = self._rows.setdefault(direction, [0, 0, 0.0, 0.0])
            row[0] += 1
            row[1] += nbytes
            row[2] += wall_s
            row[3] += sim_s

    def totals(self) -> list[DirectionTotals]:
        with self._lock:
            return [
                DirectionTotals(d, int(r[0]), int(r[1]), r[2], r[3]) for d, r in sorted(self._rows.items())
            ]

    def reset(self) -> None:
        with self._lock:
            self._rows.clear()
