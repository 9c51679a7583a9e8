"""Store configuration: one flat mapping, each store validating the keys it owns.

Keys are ``"<store>.<name>"`` (``"posix.dirs"``, ``"cache.capacity"``, ``"pipeline.write"``),
plus ``"store"`` for the store or pipeline spec. Values may be native (``4 << 30``,
``True``, a list) or strings as they come from YAML, JSON or a command line (``"4GiB"``,
``"true"``, ``"/a,/b"``). Each store describes its keys with :class:`Key` and turns the
mapping into a frozen dataclass through :func:`parse_keys`; an unknown key, a missing
required one or a bad value is a ``ValueError`` naming the key and the known keys.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvfabric.envs import parse_size
from kvfabric.platform.checksum import Verify

REQUIRED = object()


@dataclass(frozen=True)
class Key:
    """One configuration key of a store: parser, default (``REQUIRED`` if none), meaning."""

    name: str
    parse: Callable[[Any], Any]
    default: Any
    doc: str


def parse_keys(prefix: str, keys: Sequence[Key], config: Mapping[str, Any]) -> dict[str, Any]:
    """Values of ``prefix.*`` keys of ``config`` parsed by ``keys``; other prefixes ignored."""
    known = {k.name: k for k in keys}
    mine = {name[len(prefix) + 1 :]: v for name, v in config.items() if name.startswith(prefix + ".")}
    unknown = sorted(set(mine) - set(known))
    if unknown:
        raise ValueError(
            f"unknown config key(s) {', '.join(f'{prefix}.{u}' for u in unknown)} for {prefix!r}; "
            f"known: {', '.join(f'{prefix}.{k}' for k in sorted(known))}"
        )
    out: dict[str, Any] = {}
    for k in keys:
        if k.name not in mine:
            if k.default is REQUIRED:
                raise ValueError(f"config key {prefix}.{k.name} is required ({k.doc})")
            out[k.name] = k.default
            continue
        try:
            out[k.name] = k.parse(mine[k.name])
        except (TypeError, ValueError) as e:
            raise ValueError(f"bad value for config key {prefix}.{k.name}={mine[k.name]!r}: {e}") from None
    return out


def describe(prefix: str, keys: Sequence[Key]) -> list[tuple[str, str, str]]:
    """``(key, default, meaning)`` rows, for documentation and ``--help`` text."""
    return [
        (f"{prefix}.{k.name}", "required" if k.default is REQUIRED else repr(k.default), k.doc) for k in keys
    ]


# ---------------------------------------------------------------------------- parsers
def as_size(v: Any) -> int:
    return parse_size(v)


def as_bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str):
        t = v.strip().lower()
        if t in ("1", "true", "yes", "on"):
            return True
        if t in ("0", "false", "no", "off"):
            return False
    raise ValueError(f"expected a boolean (true/false), got {v!r}")


def as_verify(v: Any) -> Verify:
    """``on`` / ``off`` (or a boolean): whether loads check the writer's checksum."""
    return Verify.parse(v)


def as_int(lo: int, hi: int | None = None) -> Callable[[Any], int]:
    def parse(v: Any) -> int:
        if isinstance(v, bool):
            raise TypeError(f"expected an int, got {v!r}")
        n = int(v.strip()) if isinstance(v, str) else v
        if not isinstance(n, int):
            raise TypeError(f"expected an int, got {type(v).__name__}")
        if n < lo or (hi is not None and n > hi):
            raise ValueError(f"must be in [{lo}, {'inf' if hi is None else hi}], got {n}")
        return n

    return parse


def as_float(lo: float, hi: float | None = None) -> Callable[[Any], float]:
    def parse(v: Any) -> float:
        if isinstance(v, bool):
            raise TypeError(f"expected a number, got {v!r}")
        x = float(v)
        if x != x or x in (float("inf"), float("-inf")):
            raise ValueError(f"expected a finite number, got {v!r}")
        if x < lo or (hi is not None and x > hi):
            raise ValueError(f"must be in [{lo}, {'inf' if hi is None else hi}], got {x}")
        return x

    return parse


def as_choice(*choices: str) -> Callable[[Any], str]:
    def parse(v: Any) -> str:
        t = str(v).strip().lower()
        if t not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}, got {v!r}")
        return t

    return parse


def as_paths(v: Any) -> tuple[str, ...]:
    """A list of directories, or one string of them separated by commas."""
    items = v.split(",") if isinstance(v, str) else list(v)
    paths = tuple(os.path.abspath(os.path.expanduser(str(p).strip())) for p in items if str(p).strip())
    if not paths:
        raise ValueError("needs at least one directory")
    if len(set(paths)) != len(paths):
        raise ValueError(f"lists a directory twice: {list(paths)}")
    return paths
