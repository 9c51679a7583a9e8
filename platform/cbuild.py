"""Compile-on-first-use of small cffi extension modules, cached by source hash.

``load(prefix, source, cdef)`` compiles ``source`` (C) exposing the declarations in
``cdef`` into ``KVFABRIC_CACHE_DIR/native/<prefix>_<hash>.*.so`` the first time it is
asked for on a machine, then imports it. Concurrent builders (several processes starting
at once) race harmlessly: each builds in a private directory and renames into place.
Raises ``ImportError`` (with the compiler's reason) when no compiler is available.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import tempfile
import threading
from pathlib import Path
from types import ModuleType

from kvfabric.envs import KVFABRIC_CACHE_DIR

_lock = threading.Lock()
_loaded: dict[str, ModuleType] = {}


def _build(cache: Path, modname: str, source: str, cdef: str) -> Path:
    try:
        import cffi
    except ImportError as e:  # pragma: no cover - cffi is a core dependency
        raise ImportError(f"cffi is needed to build {modname}: {e}") from e
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{modname}.", dir=cache))
    try:
        ffi = cffi.FFI()
        ffi.cdef(cdef)
        ffi.set_source(modname, source, extra_compile_args=["-O2"])
        try:
            built = Path(ffi.compile(tmpdir=str(tmp), verbose=False))
        except Exception as e:
            raise ImportError(f"compiling {modname} failed: {e}") from e
        final = cache / built.name
        os.replace(built, final)
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load(prefix: str, source: str, cdef: str) -> ModuleType:
    """The compiled module for (``source``, ``cdef``); it has ``.ffi`` and ``.lib``."""
    digest = hashlib.sha256((source + "\0" + cdef).encode()).hexdigest()[:16]
    modname = f"{prefix}_{digest}"
    with _lock:
        if modname in _loaded:
            return _loaded[modname]
        cache = Path(KVFABRIC_CACHE_DIR.get()) / "native"
        found = sorted(cache.glob(f"{modname}.*.so")) + sorted(cache.glob(f"{modname}.so"))
        path = found[0] if found else _build(cache, modname, source, cdef)
        loader = importlib.machinery.ExtensionFileLoader(modname, str(path))
        spec = importlib.util.spec_from_file_location(modname, path, loader=loader)
        if spec is None:
            raise ImportError(f"cannot load {path}")
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        _loaded[modname] = module
        return module
