"""Typed configuration fields: every key of a config dataclass checked against its annotation.

A frozen config dataclass calls :func:`coerce_fields` first thing in ``__post_init__``;
each field's value is then checked, and converted where a config file or a command line
spells it as text, by what the field's annotation says, so a new field is covered by its
annotation alone:

==================  ===============================================================
``bool``            ``True``/``False``, ``0``/``1``, or ``true/false``, ``on/off``,
                    ``yes/no``, ``1/0`` (any case); anything else (``maybe``) fails
``int``             an int (not a bool), or a string of one (``"8192"``, ``"1_000"``)
``Size``            bytes: an int >= 0 or a string like ``"4GiB"`` (``envs.parse_size``)
``float``           a finite int or float (not a bool), or a string of one
``str``             a string (YAML turns ``token: 12345`` into an int: quote it)
``X | None``        ``None``, or what ``X`` accepts
``tuple[T, ...]``   a list or tuple of what ``T`` accepts; for ``T = str`` also one
                    comma-separated string
``Mapping[...]``    a mapping
a class             an instance of it
``Any``             anything
==================  ===============================================================

A wrong value is a ``ValueError`` naming the key, the value and what was expected.
:func:`from_mapping` builds a config from a mapping (a parsed YAML file) and refuses
unknown keys with the sorted list of the known ones. Leaf module: imports only ``envs``.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Mapping
from typing import Annotated, Any, TypeVar

from kvfabric.envs import parse_size


class _SizeMarker:
    def __repr__(self) -> str:
        return "Size"


SIZE = _SizeMarker()
Size = Annotated[int, SIZE]  # a byte count; accepts "4GiB" style strings
T = TypeVar("T")

_BOOLS = {"true": True, "on": True, "yes": True, "1": True}
_BOOLS.update({"false": False, "off": False, "no": False, "0": False})
BOOL_WORDS = "true/false, on/off, yes/no, 1/0"


class _Bad(Exception):
    """What was expected (internal: turned into a ValueError naming the key)."""


def parse_bool(value: Any) -> bool:
    """A boolean from a bool, 0/1 or one of ``BOOL_WORDS``; ``ValueError`` otherwise."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _BOOLS:
        return _BOOLS[value.strip().lower()]
    raise ValueError(f"expected a boolean ({BOOL_WORDS}), got {value!r}")


def _int(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise _Bad("an integer")


def _float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise _Bad("a number")
    try:
        x = float(value)
    except ValueError:
        raise _Bad("a number") from None
    if not math.isfinite(x):
        raise _Bad("a finite number")
    return x


def _convert(value: Any, hint: Any) -> Any:
    """``value`` checked (and converted from text) as ``hint`` says; ``_Bad`` if not."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin is Annotated:
        if SIZE in args[1:]:
            try:
                return parse_size(value)
            except ValueError as e:
                raise _Bad(f"a size in bytes: {e}") from None
            except TypeError:
                raise _Bad("a size in bytes (an int >= 0 or a string like '4GiB')") from None
        return _convert(value, args[0])
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        wanted = []
        for a in options:
            try:
                return _convert(value, a)
            except _Bad as e:
                wanted.append(str(e))
        raise _Bad(" or ".join(wanted) + (" or null" if type(None) in args else ""))
    if hint is bool:
        try:
            return parse_bool(value)
        except ValueError:
            raise _Bad(f"a boolean ({BOOL_WORDS})") from None
    if hint is int:
        return _int(value)
    if hint is float:
        return _float(value)
    if hint is str:
        if not isinstance(value, str):
            raise _Bad("a string")
        return value
    if origin is tuple:
        item = args[0] if args else Any
        if isinstance(value, str) and item is str:
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise _Bad(f"a list of {_name(item)}")
        try:
            return tuple(_convert(v, item) for v in value)
        except _Bad as e:
            raise _Bad(f"a list of {_name(item)} (an item is not {e})") from None
    if hint is dict or (isinstance(origin, type) and issubclass(origin, Mapping)):
        if not isinstance(value, Mapping):
            raise _Bad("a mapping")
        return value
    if isinstance(hint, type):
        if not isinstance(value, hint):
            raise _Bad(f"a {hint.__name__}")
        return value
    return value


def _name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint)


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls, include_extras=True)
    return _HINTS[cls]


def coerce_fields(obj: Any, label: Callable[[str], str]) -> None:
    """Check and convert every field of the frozen dataclass ``obj`` in place (see module
    docstring); ``label(key)`` names a key in errors (``"pool config dram"``)."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        try:
            new = _convert(value, hints[f.name])
        except _Bad as e:
            raise ValueError(f"{label(f.name)}={value!r}: expected {e}") from None
        if new is not value:
            object.__setattr__(obj, f.name, new)


def from_mapping(cls: Callable[..., T], data: Mapping[str, Any], what: str, **overrides: Any) -> T:
    """``cls(**data, **overrides)`` (overrides that are None are left out) after refusing
    unknown keys: ``ValueError`` listing them and the known ones, sorted."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{what} must be a mapping of keys to values, got {type(data).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    merged = {**dict(data), **{k: v for k, v in overrides.items() if v is not None}}
    unknown = sorted(str(k) for k in set(merged) - known)
    if unknown:
        raise ValueError(f"unknown {what} key(s) {unknown}; known: {sorted(known)}")
    return cls(**merged)
