"""The platform layer's public names in one import: ``from kvfabric.platform.api import ...``."""

from kvfabric.platform.base import Platform
from kvfabric.platform.buffer import Buffer
from kvfabric.platform.registry import available, create, default, detect, register, resolve_name
from kvfabric.platform.stream import Event, Stream
from kvfabric.platform.types import (
    BufferKind,
    CopyBatch,
    DeviceInfo,
    Direction,
    Medium,
    PlatformInfo,
    Span,
)

__all__ = [
    "Buffer",
    "BufferKind",
    "CopyBatch",
    "DeviceInfo",
    "Direction",
    "Event",
    "Medium",
    "Platform",
    "PlatformInfo",
    "Span",
    "Stream",
    "available",
    "create",
    "default",
    "detect",
    "register",
    "resolve_name",
]
