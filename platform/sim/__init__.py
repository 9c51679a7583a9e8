"""The sim platform: the whole device contract on host memory, for CPU-only machines."""

from kvfabric.platform.sim.backend import SimConfig, SimPlatform
from kvfabric.platform.sim.cost import PRESETS, CostModel, LinkCost

__all__ = ["PRESETS", "CostModel", "LinkCost", "SimConfig", "SimPlatform"]
