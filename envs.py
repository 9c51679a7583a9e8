"""Every environment variable kvfabric reads, parsed in one place.

Each accessor reads the environment when called (so tests may set variables at run
time), validates the value, and raises ``ValueError`` naming the variable on a bad one.
This module is a leaf: it imports nothing of kvfabric.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 1000**4,
    "tib": 1 << 40,
}


def parse_size(text: str | int) -> int:
    """Parse ``"4GiB"``, ``"512MB"``, ``"65536"`` or an int into a byte count (>= 0)."""
    if isinstance(text, bool):
        raise TypeError(f"size must be an int or a string like '4GiB', got {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must be >= 0, got {text}")
        return text
    if not isinstance(text, str):
        raise TypeError(f"size must be an int or a string like '4GiB', got {type(text).__name__}")
    s = text.strip().lower().replace("_", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num) :].strip()
    try:
        value = float(num)
    except ValueError:
        raise ValueError(f"cannot parse size {text!r}: expected e.g. '4GiB', '512MB', '65536'") from None
    if unit not in _SIZE_UNITS:
        raise ValueError(f"unknown size unit {unit!r} in {text!r}; use B, KiB, MiB, GiB, TiB, KB, MB, GB")
    if value < 0:
        raise ValueError(f"size must be >= 0, got {text!r}")
    return int(value * _SIZE_UNITS[unit])


def _parse_bool(text: str) -> bool:
    v = text.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false, yes/no, on/off), got {text!r}")


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    """One documented environment variable with its parser and default."""

    name: str
    parse: Callable[[str], T]
    default: T
    doc: str

    def get(self) -> T:
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default
        try:
            return self.parse(raw)
        except (TypeError, ValueError) as e:
            raise ValueError(f"bad value for environment variable {self.name}={raw!r}: {e}") from e


def _parse_platform(text: str) -> str | None:
    name = text.strip().lower()
    return name or None


KVFABRIC_PLATFORM: EnvVar[str | None] = EnvVar(
    "KVFABRIC_PLATFORM",
    _parse_platform,
    None,
    "Platform backend to use (sim, cuda, ascend or a registered name); detection when unset.",
)
KVFABRIC_SHM_DIR: EnvVar[str] = EnvVar(
    "KVFABRIC_SHM_DIR",
    str,
    "/dev/shm",
    "Directory holding POSIX shared-memory segments (a tmpfs).",
)
KVFABRIC_NATIVE: EnvVar[bool] = EnvVar(
    "KVFABRIC_NATIVE",
    _parse_bool,
    True,
    "Build and use the small C helpers (batched memcpy, atomics); 0 falls back to ctypes.",
)
KVFABRIC_CACHE_DIR: EnvVar[str] = EnvVar(
    "KVFABRIC_CACHE_DIR",
    str,
    os.path.join(os.path.expanduser("~"), ".cache", "kvfabric"),
    "Where compiled helpers and downloaded test assets are cached.",
)
KVFABRIC_LOG_LEVEL: EnvVar[str] = EnvVar(
    "KVFABRIC_LOG_LEVEL",
    lambda s: s.strip().upper(),
    "INFO",
    "Log level of the kvfabric logger.",
)


def _parse_threads(text: str) -> int | None:
    v = text.strip().lower()
    if v == "auto":
        return None
    n = int(v)
    if not 1 <= n <= 64:
        raise ValueError(f"expected 'auto' or a thread count from 1 to 64, got {text!r}")
    return n


def _parse_hugepages(s: str) -> str:
    v = s.strip().lower() or "auto"
    if v not in ("auto", "on", "off", "thp", "hugetlb"):
        raise ValueError(f"expected auto, on, off, thp or hugetlb, got {s!r}")
    return v


KVFABRIC_HUGEPAGES: EnvVar[str] = EnvVar(
    "KVFABRIC_HUGEPAGES",
    _parse_hugepages,
    "auto",
    "Pages of shareable sim buffers: auto, on, off, thp or hugetlb (platform/shm.py).",
)

KVFABRIC_COPY_THREADS: EnvVar[int | None] = EnvVar(
    "KVFABRIC_COPY_THREADS",
    _parse_threads,
    None,
    "Threads the sim platform splits a large host copy across (auto: the usable cores, at most 4).",
)

MC_TCP_BIND_ADDRESS: EnvVar[str | None] = EnvVar(
    "MC_TCP_BIND_ADDRESS",
    lambda s: s.strip() or None,
    None,
    "Mooncake's own variable: the address its transfer engine advertises; also the default "
    "GvaConfig.remote_host (127.0.0.1 when unset).",
)

ALL: tuple[EnvVar, ...] = (
    KVFABRIC_PLATFORM,
    KVFABRIC_SHM_DIR,
    KVFABRIC_NATIVE,
    KVFABRIC_CACHE_DIR,
    KVFABRIC_LOG_LEVEL,
    KVFABRIC_COPY_THREADS,
    KVFABRIC_HUGEPAGES,
    MC_TCP_BIND_ADDRESS,
)

__all__ = ["ALL", "EnvVar", "parse_size"] + [v.name for v in ALL]
