"""Store configuration: one flat mapping, each store validating the keys it owns.

Keys are ``"<store>.<name>"`` (``"posix.dirs"``, ``"cache.capacity"``, ``"pipeline.write"``),
plus ``"store"`` for the store or pipeline spec. Values may be native (``4 << 30``,
``True``, a list) or strings as they come from YAML, JSON or a command line (``"4GiB"``,
``"true"``, ``"/a,/b"``). Each store's configuration is a frozen dataclass of
:func:`kvfabric.settings.setting` fields, the one configuration language of kvfabric, and
:class:`StoreConfig` reads its ``<prefix>.*`` section of the mapping (other prefixes are
ignored here; ``registry.check_keys`` refuses keys of no tier): an unknown key, a missing
required one or a bad value is a ``ValueError`` naming the key and the known keys.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, TypeVar

from kvfabric.platform.checksum import Verify
from kvfabric.settings import Expected, coerce_fields, load
from kvfabric.settings import describe as describe_class

C = TypeVar("C", bound="StoreConfig")


class StoreConfig:
    """Base of the store configs (frozen dataclasses): ``PREFIX`` names their section.

    Contract: a subclass is a ``@dataclass(frozen=True)`` of ``setting`` fields; its
    ``__post_init__`` (if any) calls ``super().__post_init__()`` first, which checks every
    field (``kvfabric.settings.coerce_fields``, errors ``bad value for config key
    <prefix>.<key>=...``)."""

    PREFIX: ClassVar[str] = ""

    def __post_init__(self) -> None:
        coerce_fields(self, lambda key: f"bad value for config key {self.PREFIX}.{key}")

    @classmethod
    def from_mapping(cls: type[C], config: Mapping[str, Any]) -> C:
        """The config from the ``<PREFIX>.*`` keys of one flat store mapping."""
        return load(cls, config, what="config", prefix=cls.PREFIX)

    @classmethod
    def from_flags(cls: type[C], flags: Iterable[str]) -> C:
        """The config from ``<PREFIX>.<key>=value`` strings (others ignored)."""
        return load(cls, None, what="config", prefix=cls.PREFIX, flags=flags)


def describe(prefix: str, config: type) -> list[tuple[str, str, str]]:
    """``(key, default, meaning)`` rows of a store config class, keys ``prefix.*``, for
    documentation and ``--help`` text."""
    return describe_class(config, prefix)


# ---------------------------------------------------------------------------- parsers
def as_verify(v: Any) -> Verify:
    """``on`` / ``off`` (or a boolean): whether loads check the writer's checksum."""
    try:
        return Verify.parse(v)
    except ValueError:
        raise Expected(f"one of {', '.join(m.value for m in Verify)}") from None


def as_paths(v: Any) -> tuple[str, ...]:
    """A list of directories, or one string of them separated by commas."""
    if not isinstance(v, (str, list, tuple)):
        raise Expected("a list of directories or one comma-separated string")
    items = v.split(",") if isinstance(v, str) else list(v)
    paths = tuple(os.path.abspath(os.path.expanduser(str(p).strip())) for p in items if str(p).strip())
    if not paths:
        raise ValueError("needs at least one directory")
    if len(set(paths)) != len(paths):
        raise ValueError(f"lists a directory twice: {list(paths)}")
    return paths
