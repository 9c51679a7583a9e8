"""One registry type for every pluggable axis of kvfabric: names to lazily imported objects.

Each axis (platforms, stores, store indexes, sparse algorithms, benchmarks, the peer
stores the benchmarks drive, GVA transports, rendezvous kinds) keeps one
:class:`Registry` next to the interface its entries implement. An entry is a target
string, ``"package.module:attr"`` (a class or a function) or ``"package.module"`` (a
module), imported only when it is first used, so a vendor SDK or a peer's client library
loads only in the process that picks it.

Where entries come from, in order of precedence (a later source never replaces an earlier
name): the built-in entries, names registered at run time (:meth:`Registry.register`),
and installed plugins through the entry-point group of the axis (``kvfabric.<axis>``,
for example ``[project.entry-points."kvfabric.stores"] mine = "pkg.mod:MyStore"``). A
built-in name cannot be replaced; a registered name can, with ``replace=True``.

Errors name the axis and list the known names (an unknown name), or name the module that
failed to import and the extra to install (a known name whose dependencies are missing).
Thread-safe.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

T = TypeVar("T")

ENTRY_POINT_PREFIX = "kvfabric."


class Registry(Generic[T]):
    """Names of one axis to lazily imported targets (see the module docstring).

    ``kind``: when given, a loaded class must be a subclass of it (checked at load);
    ``hint``: the install advice for a name whose module fails to import (e.g.
    ``"pip install 'kvfabric[cuda]'"``)."""

    def __init__(
        self,
        axis: str,
        builtin: Mapping[str, str],
        *,
        group: str | None = None,
        kind: type | None = None,
        hint: Callable[[str], str | None] | None = None,
    ) -> None:
        for name, target in builtin.items():
            _check_entry(axis, name, target)
        self.axis = axis
        self.group = group if group is not None else ENTRY_POINT_PREFIX + axis.replace(" ", "_") + "s"
        self._builtin = dict(builtin)
        self._registered: dict[str, str] = {}
        self._kind, self._hint = kind, hint
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ entries
    def register(self, name: str, target: str, *, replace: bool = False) -> None:
        """Add ``name`` -> ``target``; a built-in name is refused, a registered one too
        unless ``replace``."""
        _check_entry(self.axis, name, target)
        with self._lock:
            if name in self._builtin:
                raise ValueError(f"{self.axis} {name!r} is built in and cannot be replaced")
            if name in self._registered and not replace and self._registered[name] != target:
                raise ValueError(
                    f"{self.axis} {name!r} is already registered as {self._registered[name]!r} "
                    "(pass replace=True to replace it)"
                )
            self._registered[name] = target

    def unregister(self, name: str) -> None:
        """Remove a name registered at run time (tests, plugins that unload)."""
        with self._lock:
            self._registered.pop(name, None)

    def targets(self) -> dict[str, str]:
        """Every known name and its target (built-in, registered, plugins)."""
        out = dict(self._entry_points())
        with self._lock:
            out.update(self._registered)
        out.update(self._builtin)
        return out

    def names(self) -> list[str]:
        return sorted(self.targets())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self.targets()

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def target(self, name: str) -> str:
        """The target of ``name``; an unknown name is a ``ValueError`` listing the known ones.
        A built-in or registered name is answered without reading the installed plugins
        (built-in names win over plugins anyway): loading one per request or layer, as the
        sparse scorers are, must not scan the package metadata each time."""
        if isinstance(name, str):
            if name in self._builtin:
                return self._builtin[name]
            with self._lock:
                registered = self._registered.get(name)
            if registered is not None:
                return registered
        found = self.targets().get(name) if isinstance(name, str) else None
        if found is None:
            raise ValueError(f"unknown {self.axis} {name!r}; known: {', '.join(self.names()) or 'none'}")
        return found

    # ------------------------------------------------------------------ loading
    def load(self, name: str) -> T:
        """The object ``name`` names, imported now (a module for a ``"package.module"`` target)."""
        target = self.target(name)
        module_name, _, attr = target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            advice = self._hint(name) if self._hint is not None else None
            raise ImportError(
                f"{self.axis} {name!r} needs {module_name!r}, which failed to import: {e}"
                + (f". {advice}" if advice else "")
            ) from e
        obj = getattr(module, attr, None) if attr else module
        if obj is None:
            raise ImportError(f"{module_name!r} has no {attr!r} ({self.axis} {name!r})")
        if self._kind is not None and not (isinstance(obj, type) and issubclass(obj, self._kind)):
            raise TypeError(f"{target!r} ({self.axis} {name!r}) is not a {self._kind.__name__}")
        return obj  # type: ignore[return-value]

    def create(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """``load(name)(*args, **kwargs)``."""
        return self.load(name)(*args, **kwargs)  # type: ignore[operator]

    def _entry_points(self) -> dict[str, str]:
        """The plugins installed now (read on every call, so a plugin installed later is
        seen; ``target`` reads them only for a name that is neither built in nor registered)."""
        try:
            eps = importlib.metadata.entry_points(group=self.group)
            return {ep.name: ep.value for ep in eps}
        except Exception:  # noqa: BLE001 - broken metadata must not break the built-in names
            return {}

    def __repr__(self) -> str:
        return f"Registry({self.axis!r}: {', '.join(self.names())})"


def _check_entry(axis: str, name: object, target: object) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{axis} name must be a non-empty string, got {name!r}")
    if not isinstance(target, str) or not target or target.startswith(":") or target.endswith(":"):
        raise ValueError(
            f"{axis} {name!r}: the target must be 'package.module:attr' or 'package.module', got {target!r}"
        )
