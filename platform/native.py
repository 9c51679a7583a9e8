"""Native helpers (batched memcpy, gather/scatter, atomics, fences) compiled on first use.

``get()`` returns a :class:`Native` whose methods take numpy address arrays. The C source
(``_native.c``) is compiled once per source hash (``cbuild.py``).
When no compiler is available, or ``KVFABRIC_NATIVE=0``, a ctypes fallback with the same
methods is returned; its ``atomics_are_real`` is False (plain loads/stores are still
single-copy atomic for aligned 8-byte words on x86-64 and ARMv8, but read-modify-write
operations are not atomic across processes).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np

from kvfabric.envs import KVFABRIC_NATIVE
from kvfabric.platform import cbuild

log = logging.getLogger("kvfabric.native")

_SRC_PATH = Path(__file__).with_name("_native.c")
_CDEF = """
void kvf_memcpy_batch(const uint64_t *dst, const uint64_t *src, const uint64_t *n, uint64_t k);
uint64_t kvf_gather(uint64_t dst, const uint64_t *src, const uint64_t *n, uint64_t k);
uint64_t kvf_scatter(const uint64_t *dst, uint64_t src, const uint64_t *n, uint64_t k);
uint64_t kvf_load_acquire_u64(uint64_t addr);
void kvf_store_release_u64(uint64_t addr, uint64_t value);
uint64_t kvf_fetch_add_u64(uint64_t addr, uint64_t delta);
int kvf_cas_u64(uint64_t addr, uint64_t expected, uint64_t desired);
void kvf_fence_acquire(void);
void kvf_fence_release(void);
void kvf_fence_seq_cst(void);
"""


def _u64(a: np.ndarray) -> np.ndarray:
    return a if (a.dtype == np.uint64 and a.flags.c_contiguous) else np.ascontiguousarray(a, np.uint64)


class Native:
    """Helpers backed by the compiled C module."""

    atomics_are_real = True

    def __init__(self, module: Any) -> None:
        self._ffi = module.ffi
        self._lib = module.lib

    def _p(self, a: np.ndarray) -> Any:
        return self._ffi.from_buffer("uint64_t[]", a)

    def memcpy_batch(self, dst: np.ndarray, src: np.ndarray, n: np.ndarray) -> None:
        d, s, k = _u64(dst), _u64(src), _u64(n)
        self._lib.kvf_memcpy_batch(self._p(d), self._p(s), self._p(k), k.size)

    def gather(self, dst: int, src: np.ndarray, n: np.ndarray) -> int:
        s, k = _u64(src), _u64(n)
        return int(self._lib.kvf_gather(dst, self._p(s), self._p(k), k.size))

    def scatter(self, dst: np.ndarray, src: int, n: np.ndarray) -> int:
        d, k = _u64(dst), _u64(n)
        return int(self._lib.kvf_scatter(self._p(d), src, self._p(k), k.size))

    def load_acquire(self, addr: int) -> int:
        return int(self._lib.kvf_load_acquire_u64(addr))

    def store_release(self, addr: int, value: int) -> None:
        self._lib.kvf_store_release_u64(addr, value)

    def fetch_add(self, addr: int, delta: int) -> int:
        return int(self._lib.kvf_fetch_add_u64(addr, delta & 0xFFFFFFFFFFFFFFFF))

    def cas(self, addr: int, expected: int, desired: int) -> bool:
        return bool(self._lib.kvf_cas_u64(addr, expected, desired))

    def fence_acquire(self) -> None:
        self._lib.kvf_fence_acquire()

    def fence_release(self) -> None:
        self._lib.kvf_fence_release()

    def fence(self) -> None:
        self._lib.kvf_fence_seq_cst()


class CtypesNative:
    """The same helpers in ctypes: correct copies, non-atomic read-modify-write."""

    atomics_are_real = False

    def memcpy_batch(self, dst: np.ndarray, src: np.ndarray, n: np.ndarray) -> None:
        for d, s, k in zip(dst.tolist(), src.tolist(), n.tolist()):
            ctypes.memmove(d, s, k)

    def gather(self, dst: int, src: np.ndarray, n: np.ndarray) -> int:
        off = 0
        for s, k in zip(src.tolist(), n.tolist()):
            ctypes.memmove(dst + off, s, k)
            off += k
        return off

    def scatter(self, dst: np.ndarray, src: int, n: np.ndarray) -> int:
        off = 0
        for d, k in zip(dst.tolist(), n.tolist()):
            ctypes.memmove(d, src + off, k)
            off += k
        return off

    def load_acquire(self, addr: int) -> int:
        return int(ctypes.c_uint64.from_address(addr).value)

    def store_release(self, addr: int, value: int) -> None:
        ctypes.c_uint64.from_address(addr).value = value

    def fetch_add(self, addr: int, delta: int) -> int:
        cell = ctypes.c_uint64.from_address(addr)
        old = int(cell.value)
        cell.value = (old + delta) & 0xFFFFFFFFFFFFFFFF
        return old

    def cas(self, addr: int, expected: int, desired: int) -> bool:
        cell = ctypes.c_uint64.from_address(addr)
        if int(cell.value) != expected:
            return False
        cell.value = desired
        return True

    def fence_acquire(self) -> None:
        pass

    def fence_release(self) -> None:
        pass

    def fence(self) -> None:
        pass


_lock = threading.Lock()
_cached: Native | CtypesNative | None = None


def _load() -> Native:
    return Native(cbuild.load("_kvf_native", _SRC_PATH.read_text(), _CDEF))


def get() -> Native | CtypesNative:
    """The helpers: compiled when possible, else the ctypes fallback (logged once)."""
    global _cached
    if _cached is not None:
        return _cached
    with _lock:
        if _cached is None:
            if not KVFABRIC_NATIVE.get():
                _cached = CtypesNative()
            else:
                try:
                    _cached = _load()
                except Exception as e:  # noqa: BLE001 - no compiler, no headers, ...
                    log.warning("kvfabric native helpers unavailable (%s); using ctypes", e)
                    _cached = CtypesNative()
    return _cached
