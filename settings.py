"""kvfabric's one configuration language: frozen dataclasses whose fields say their type,
range, choices and meaning, and one loader for mappings, YAML files and ``key=value`` flags.

A config class is a frozen dataclass; each field is declared with :func:`setting`
(``workers: int = setting(2, doc="threads", lo=1, hi=64)``) or a plain default, and
``__post_init__`` calls :func:`coerce_fields` first. Each value is then checked, and
converted where a config file or a command line spells it as text, by what the field's
annotation says, so a new field is covered by its annotation alone:

==================  ===============================================================
``bool``            ``True``/``False``, ``0``/``1``, or ``true/false``, ``on/off``,
                    ``yes/no``, ``1/0`` (any case); anything else (``maybe``) fails
``int``             an int (not a bool), or a string of one (``"8192"``, ``"1_000"``)
``Size``            bytes: an int >= 0 or a string like ``"4GiB"`` (``envs.parse_size``)
``float``           a finite int or float (not a bool), or a string of one
``str``             a string (YAML turns ``token: 12345`` into an int: quote it)
an ``Enum``         a member, or its value as text (its ``parse`` classmethod if it has one)
``X | None``        ``None``, or what ``X`` accepts
``tuple[T, ...]``   a list or tuple of what ``T`` accepts; for ``T = str`` also one
                    comma-separated string
``Mapping[...]``    a mapping
a class             an instance of it
``Any``             anything
==================  ===============================================================

then by the field's metadata (:func:`setting`): ``parse`` (a callable that replaces the
annotation's conversion; it raises :class:`Expected` naming what it wanted), ``lo`` /
``hi`` (inclusive bounds) and ``gt`` (an exclusive lower bound) for numbers, ``choices``
(the allowed strings, or a callable returning them, e.g. a registry's names; for a tuple
each item must be one). A wrong value is a ``ValueError`` naming the key, the value and
what was expected (``pool config rpc_spin_us=-1: expected a number in [0, 10000]``).

Loading (:func:`load`, and :func:`from_mapping` / :func:`from_file` / :func:`from_flags`
over it): a YAML file, then a mapping, then ``key=value`` flags, then keyword overrides,
later ones winning. With ``prefix="posix"`` the keys are the flat ``"posix.dirs"`` form of
the stores (a section of one mapping shared by several configs: keys of other prefixes
are ignored, a nested ``posix: {dirs: ...}`` section counts too). Unknown keys are refused
with the sorted list of the known ones, missing required ones are named with their
meaning. :func:`describe` gives ``(key, default, meaning)`` rows for docs and ``--help``.

Leaf module: imports only ``envs`` (and ``yaml`` when a file is read).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, TypeVar

from kvfabric.envs import parse_size


class _SizeMarker:
    def __repr__(self) -> str:
        return "Size"


SIZE = _SizeMarker()
Size = Annotated[int, SIZE]  # a byte count; accepts "4GiB" style strings
T = TypeVar("T")
META = "kvfabric.setting"  # the key of a field's Setting in its dataclass metadata

_BOOLS = {"true": True, "on": True, "yes": True, "1": True}
_BOOLS.update({"false": False, "off": False, "no": False, "0": False})
BOOL_WORDS = "true/false, on/off, yes/no, 1/0"


class Expected(ValueError):
    """Raised by a converter: the message says what was expected (``"a boolean or 'auto'"``);
    :func:`coerce_fields` turns it into an error naming the key and the value."""


@dataclasses.dataclass(frozen=True)
class Setting:
    """What :func:`setting` records about a field (see the module docstring)."""

    doc: str = ""
    lo: float | None = None
    hi: float | None = None
    gt: float | None = None
    choices: tuple[str, ...] | Callable[[], Iterable[str]] | None = None
    parse: Callable[[Any], Any] | None = None

    def allowed(self) -> tuple[str, ...] | None:
        if self.choices is None:
            return None
        return tuple(self.choices() if callable(self.choices) else self.choices)

    def bounds(self) -> str:
        """The range as text (``"in [1, 64]"``, ``">= 0"``, ``"> 0"``), or ``""``."""
        parts = []
        if self.lo is not None and self.hi is not None:
            return f"in [{_num(self.lo)}, {_num(self.hi)}]"
        if self.gt is not None:
            parts.append(f"> {_num(self.gt)}")
        if self.lo is not None:
            parts.append(f">= {_num(self.lo)}")
        if self.hi is not None:
            parts.append(f"<= {_num(self.hi)}")
        return " and ".join(parts)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else str(x)


def setting(
    default: Any = dataclasses.MISSING,
    *,
    doc: str = "",
    lo: float | None = None,
    hi: float | None = None,
    gt: float | None = None,
    choices: Iterable[str] | Callable[[], Iterable[str]] | None = None,
    parse: Callable[[Any], Any] | None = None,
    default_factory: Callable[[], Any] | Any = dataclasses.MISSING,
) -> Any:
    """A dataclass field with its meaning and checks (see the module docstring); no
    ``default`` (nor ``default_factory``) makes the key required."""
    if choices is not None and not callable(choices):
        choices = tuple(choices)
    meta = {META: Setting(doc, lo, hi, gt, choices, parse)}  # type: ignore[arg-type]
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def setting_of(f: dataclasses.Field[Any]) -> Setting:
    """The :class:`Setting` of a dataclass field (an empty one for a plain field)."""
    return f.metadata.get(META) or Setting()


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
    raise Expected(f"a boolean ({BOOL_WORDS})")


def parse_auto_bool(value: Any) -> bool | None:
    """A boolean, or ``None`` for ``None`` / ``"auto"`` (decided later)."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    try:
        return parse_bool(value)
    except ValueError:
        raise Expected(f"a boolean ({BOOL_WORDS}) or 'auto'") from None


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


def _enum(value: Any, hint: type[enum.Enum]) -> enum.Enum:
    if isinstance(value, hint):
        return value
    values = ", ".join(str(m.value) for m in hint)
    parse = getattr(hint, "parse", None)
    if parse is not None:
        try:
            return parse(value)
        except (TypeError, ValueError):
            raise _Bad(f"one of {values}") from None
    for m in hint:
        if isinstance(value, str) and value.strip().lower() in (str(m.value).lower(), m.name.lower()):
            return m
        if value == m.value:
            return m
    raise _Bad(f"one of {values}")


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
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return _enum(value, hint)
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


def _checked(value: Any, s: Setting) -> Any:
    """``value`` (already converted) within the range and choices of ``s``; ``_Bad`` if not."""
    if value is None:
        return value
    if s.lo is not None or s.hi is not None or s.gt is not None:
        below = (s.lo is not None and value < s.lo) or (s.gt is not None and value <= s.gt)
        if below or (s.hi is not None and value > s.hi):
            kind = "an integer" if isinstance(value, int) else "a number"
            raise _Bad(f"{kind} {s.bounds()}")
    allowed = s.allowed()
    if allowed is not None:
        items = value if isinstance(value, tuple) else (value,)
        fixed = tuple(v.strip().lower() if isinstance(v, str) else v for v in items)
        if any(v not in allowed for v in fixed):
            raise _Bad(f"{'a list of ' if isinstance(value, tuple) else ''}one of {', '.join(allowed)}")
        value = fixed if isinstance(value, tuple) else fixed[0]
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
        s = setting_of(f)
        try:
            new = s.parse(value) if s.parse is not None else _convert(value, hints[f.name])
            new = _checked(new, s)
        except (_Bad, Expected) as e:
            raise ValueError(f"{label(f.name)}={value!r}: expected {e}") from None
        except (TypeError, ValueError) as e:
            raise ValueError(f"{label(f.name)}={value!r}: {e}") from None
        if new is not value:
            object.__setattr__(obj, f.name, new)


# ---------------------------------------------------------------------------- loading
def required(cls: type) -> list[str]:
    """The fields of ``cls`` with neither a default nor a default factory."""
    return [
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]


def parse_flags(flags: Iterable[str], what: str = "config") -> dict[str, str]:
    """``["posix.dirs=/a,/b", "cache.capacity=4GiB"]`` -> a mapping of the texts (converted
    later by the fields' types); a flag without ``=`` or key is a ``ValueError``."""
    out: dict[str, str] = {}
    for flag in flags:
        key, sep, value = str(flag).partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{what} flag {flag!r} is not KEY=VALUE")
        out[key.strip()] = value.strip()
    return out


def read_yaml(path: str | os.PathLike[str], what: str = "config file") -> dict[str, Any]:
    """The mapping a YAML file holds (an empty file: ``{}``); ``ValueError`` naming the file
    when it cannot be read, is not YAML or holds something else than a mapping."""
    import yaml

    p = Path(path).expanduser()
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as e:
        raise ValueError(f"{what} {str(p)!r} cannot be read: {e}") from e
    except yaml.YAMLError as e:
        raise ValueError(f"{what} {str(p)!r} is not valid YAML: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{what} {str(p)!r} must be a mapping of keys to values, got {type(data).__name__}")
    return data


def section(data: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """The ``prefix.*`` keys of a flat mapping, without the prefix (and the keys of a nested
    ``prefix: {...}`` mapping); keys of other prefixes are left out."""
    out: dict[str, Any] = {}
    nested = data.get(prefix)
    if isinstance(nested, Mapping):
        out.update(nested)
    lead = prefix + "."
    out.update({k[len(lead) :]: v for k, v in data.items() if isinstance(k, str) and k.startswith(lead)})
    return out


def load(
    cls: Callable[..., T],
    data: Mapping[str, Any] | None = None,
    *,
    what: str = "config",
    prefix: str | None = None,
    file: str | os.PathLike[str] | None = None,
    flags: Iterable[str] = (),
    **overrides: Any,
) -> T:
    """Build ``cls`` from a YAML ``file``, then ``data``, then ``flags`` (``key=value``),
    then ``overrides`` (those that are None are left out), later ones winning. ``prefix``:
    the keys are ``"<prefix>.<name>"`` in a flat mapping shared with others (see
    :func:`section`; ``overrides`` are field names). Unknown keys are refused listing the
    known ones, sorted; a missing required key is named with its meaning; each value is
    then checked by the class (:func:`coerce_fields`)."""
    if data is not None and not isinstance(data, Mapping):
        raise ValueError(f"{what} must be a mapping of keys to values, got {type(data).__name__}")
    merged: dict[str, Any] = read_yaml(file, f"{what} file") if file is not None else {}
    merged.update(data or {})
    merged.update(parse_flags(flags, what))
    if prefix is not None:
        merged = section(merged, prefix)
    merged.update({k: v for k, v in overrides.items() if v is not None})
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(str(k) for k in set(merged) - set(fields))
    if unknown and prefix is not None:
        raise ValueError(
            f"unknown {what} key(s) {', '.join(f'{prefix}.{u}' for u in unknown)} for {prefix!r}; "
            f"known: {', '.join(f'{prefix}.{k}' for k in sorted(fields))}"
        )
    if unknown:
        raise ValueError(f"unknown {what} key(s) {unknown}; known: {sorted(fields)}")
    for name in required(cls):  # type: ignore[arg-type]
        if name not in merged:
            key = f"{prefix}.{name}" if prefix is not None else name
            doc = setting_of(fields[name]).doc
            raise ValueError(f"{what} key {key} is required" + (f" ({doc})" if doc else ""))
    return cls(**merged)


def from_mapping(cls: Callable[..., T], data: Mapping[str, Any], what: str, **overrides: Any) -> T:
    """:func:`load` from a mapping (a parsed YAML file), field names as keys."""
    return load(cls, data, what=what, **overrides)


def from_file(cls: Callable[..., T], path: str | os.PathLike[str], what: str, **overrides: Any) -> T:
    """:func:`load` from a YAML file of ``key: value`` lines."""
    return load(cls, None, what=what, file=path, **overrides)


def from_flags(cls: Callable[..., T], flags: Iterable[str], what: str, **overrides: Any) -> T:
    """:func:`load` from ``key=value`` strings (a command line, environment-style lines)."""
    return load(cls, None, what=what, flags=flags, **overrides)


def _show(value: Any) -> str:
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value)


def describe(cls: type, prefix: str | None = None) -> list[tuple[str, str, str]]:
    """``(key, default, meaning)`` rows of a config class, in field order, for docs and
    ``--help``: the default is ``"required"`` for a required key, ``"computed"`` for one a
    factory computes (but an empty container), else its ``repr`` (an enum's value, a
    boolean as ``true`` / ``false``); the meaning is the field's ``doc``."""
    rows = []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = _show(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            made = f.default_factory()
            default = _show(made) if made in ((), {}, []) else "computed"
        else:
            default = "required"
        key = f"{prefix}.{f.name}" if prefix else f.name
        rows.append((key, default, setting_of(f).doc))
    return rows
