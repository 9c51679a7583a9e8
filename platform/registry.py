"""Which platform backend to use, and how to build it.

Selection order: an explicit name, then ``KVFABRIC_PLATFORM``, then detection (an Ascend
NPU, then an NVIDIA GPU), then ``sim``. Detection only looks at device nodes and whether
the SDK's package is installed (``importlib.util.find_spec``): it never imports a vendor
SDK. Backends are named by qualified class path and imported on first use; out-of-tree
backends register through the ``kvfabric.platforms`` entry-point group
(``name = "package.module:ClassName"``) or :func:`register`.
"""

from __future__ import annotations

import glob
import importlib.util
import logging
import os
import threading
from typing import TYPE_CHECKING, Any

from kvfabric.envs import KVFABRIC_PLATFORM
from kvfabric.registry import Registry

if TYPE_CHECKING:
    from kvfabric.platform.base import Platform

log = logging.getLogger("kvfabric.platform")

ENTRY_POINT_GROUP = "kvfabric.platforms"

_BUILTIN: dict[str, str] = {
    "sim": "kvfabric.platform.sim:SimPlatform",
    "cuda": "kvfabric.platform.cuda:CudaPlatform",
    "ascend": "kvfabric.platform.ascend:AscendPlatform",
}
PLATFORMS: Registry[type[Platform]] = Registry(
    "platform",
    _BUILTIN,
    group=ENTRY_POINT_GROUP,
    hint=lambda name: f"Install the extra: pip install 'kvfabric[{name}]'",
)
_lock = threading.Lock()
_default: Platform | None = None


def register(name: str, target: str) -> None:
    """Register ``name`` -> ``"module:Class"`` (a Platform subclass), e.g. from a plugin."""
    if not name or ":" not in target:
        raise ValueError(f"register needs a name and 'module:Class', got {name!r}, {target!r}")
    PLATFORMS.register(name, target, replace=True)


def available() -> dict[str, str]:
    """Every known platform name and its qualified class."""
    return PLATFORMS.targets()


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def detect() -> str:
    """The best platform for this machine, without importing any vendor SDK."""
    if (glob.glob("/dev/davinci[0-9]*") or os.environ.get("ASCEND_RT_VISIBLE_DEVICES")) and _has_module(
        "torch_npu"
    ):
        return "ascend"
    if (os.path.exists("/dev/nvidiactl") or glob.glob("/dev/nvidia[0-9]*")) and _has_module("cupy"):
        return "cuda"
    return "sim"


def resolve_name(name: str | None = None) -> str:
    """Apply the selection order to ``name`` (see module docstring)."""
    chosen = name or KVFABRIC_PLATFORM.get() or detect()
    if chosen not in available():
        raise ValueError(f"unknown platform {chosen!r}; known: {', '.join(sorted(available()))}")
    return chosen


def platform_class(name: str) -> type[Platform]:
    from kvfabric.platform.base import Platform

    cls = PLATFORMS.load(name)
    if not (isinstance(cls, type) and issubclass(cls, Platform)):
        raise ImportError(f"{PLATFORMS.target(name)!r} (platform {name!r}) is not a Platform class")
    return cls


def create(name: str | None = None, device: int = 0, **kwargs: Any) -> Platform:
    """A new platform instance of the resolved name."""
    resolved = resolve_name(name)
    return platform_class(resolved)(device=device, **kwargs)


def default() -> Platform:
    """The process-wide platform (created on first use, with the selection order)."""
    global _default
    with _lock:
        if _default is None or _default.closed:
            _default = create()
            log.info("kvfabric platform: %r", _default)
        return _default
