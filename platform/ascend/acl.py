"""``AclRuntime``: the :class:`~kvfabric.platform.runtime.DeviceRuntime` on Ascend ACL.

ACL (``libascendcl.so`` from CANN) is bound through cffi in ABI mode, so nothing is
compiled and nothing is loaded until a runtime is built. torch_npu provides only what ACL
does not: a torch view of device memory. The declarations below follow CANN's public
``acl/acl_rt.h``; ``aclrtMemcpyBatchAsync`` is looked up on first use and the platform
falls back to one ``aclrtMemcpyAsync`` per piece on CANN releases without it.
"""

from __future__ import annotations

import ctypes.util
import os
import threading
from typing import Any

import numpy as np

_CDEF = """
typedef int aclError;
typedef void *aclrtStream;
typedef void *aclrtEvent;
typedef struct { uint32_t id; int type; } aclrtMemLocation;
typedef struct { aclrtMemLocation dstLoc; aclrtMemLocation srcLoc; uint8_t rsv[16]; }
    aclrtMemcpyBatchAttr;
aclError aclInit(const char *configPath);
aclError aclrtSetDevice(int32_t deviceId);
aclError aclrtGetDeviceCount(uint32_t *count);
const char *aclrtGetSocName(void);
aclError aclrtGetMemInfo(int attr, size_t *free, size_t *total);
aclError aclrtMalloc(void **devPtr, size_t size, int policy);
aclError aclrtFree(void *devPtr);
aclError aclrtMallocHost(void **hostPtr, size_t size);
aclError aclrtFreeHost(void *hostPtr);
aclError aclrtHostRegister(void *ptr, uint64_t size, int type, void **devPtr);
aclError aclrtHostUnregister(void *ptr);
aclError aclrtMemcpyAsync(void *dst, size_t destMax, const void *src, size_t count, int kind,
                          aclrtStream stream);
aclError aclrtMemcpyBatchAsync(void **dsts, size_t *destMaxs, void **srcs, size_t *sizes,
                               size_t numBatches, aclrtMemcpyBatchAttr *attrs,
                               size_t *attrsIndexes, size_t numAttrs, size_t *failIndex,
                               aclrtStream stream);
aclError aclrtCreateStream(aclrtStream *stream);
aclError aclrtDestroyStream(aclrtStream stream);
aclError aclrtSynchronizeStream(aclrtStream stream);
aclError aclrtStreamQuery(aclrtStream stream, int *status);
aclError aclrtStreamWaitEvent(aclrtStream stream, aclrtEvent event);
aclError aclrtCreateEvent(aclrtEvent *event);
aclError aclrtDestroyEvent(aclrtEvent event);
aclError aclrtRecordEvent(aclrtEvent event, aclrtStream stream);
aclError aclrtSynchronizeEvent(aclrtEvent event);
aclError aclrtQueryEventStatus(aclrtEvent event, int *status);
aclError aclrtIpcMemGetExportKey(void *devPtr, size_t size, char *key, size_t len, uint64_t flags);
aclError aclrtIpcMemImportByKey(void **devPtr, const char *key, uint64_t flags);
aclError aclrtIpcMemClose(const char *key);
"""

ACL_SUCCESS = 0
ACL_ERROR_REPEAT_INITIALIZE = 100002
ACL_MEM_MALLOC_HUGE_FIRST = 0
ACL_HBM_MEM = 1
ACL_HOST_REGISTER_MAPPED = 0
ACL_EVENT_RECORDED_STATUS_COMPLETE = 1
ACL_STREAM_STATUS_COMPLETE = 0
ACL_MEM_LOCATION_TYPE_HOST = 0
ACL_MEM_LOCATION_TYPE_DEVICE = 1
ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION = 0x1
ACL_RT_IPC_MEM_IMPORT_FLAG_ENABLE_PEER_ACCESS = 0x1
_KEY_LEN = 65

_init_lock = threading.Lock()
_lib: Any = None
_ffi: Any = None


class AclError(RuntimeError):
    """An ACL call returned a non-zero ``aclError``."""

    def __init__(self, call: str, code: int) -> None:
        super().__init__(f"{call} returned aclError {code}")
        self.call = call
        self.code = code


def _library_path() -> str:
    explicit = os.environ.get("KVFABRIC_ACL_LIB")
    if explicit:
        return explicit
    home = os.environ.get("ASCEND_TOOLKIT_HOME") or os.environ.get("ASCEND_HOME_PATH")
    if home:
        for sub in ("lib64", "runtime/lib64"):
            cand = os.path.join(home, sub, "libascendcl.so")
            if os.path.exists(cand):
                return cand
    found = ctypes.util.find_library("ascendcl")
    if not found:
        raise ImportError("libascendcl.so not found: source CANN's set_env.sh or set ASCEND_TOOLKIT_HOME")
    return found


def load() -> tuple[Any, Any]:
    """The cffi ``(ffi, lib)`` pair for ACL, loaded and ``aclInit``-ed once per process."""
    global _lib, _ffi
    with _init_lock:
        if _lib is None:
            import cffi

            ffi = cffi.FFI()
            ffi.cdef(_CDEF)
            lib = ffi.dlopen(_library_path())
            rc = lib.aclInit(ffi.NULL)
            if rc not in (ACL_SUCCESS, ACL_ERROR_REPEAT_INITIALIZE):
                raise AclError("aclInit", rc)
            _ffi, _lib = ffi, lib
    return _ffi, _lib


class AclRuntime:
    """ACL runtime calls (see module docstring)."""

    def __init__(self, device: int = 0, ffi: Any = None, lib: Any = None) -> None:
        if lib is None:
            ffi, lib = load()
        self._ffi, self._lib = ffi, lib
        self._device = device
        self._batch_missing = False
        self._keys: dict[int, bytes] = {}
        soc = lib.aclrtGetSocName()
        self.name = f"ACL ({ffi.string(soc).decode() if soc != ffi.NULL else 'unknown SoC'})"

    def _ok(self, call: str, rc: int) -> None:
        if rc != ACL_SUCCESS:
            raise AclError(call, rc)

    def _vp(self, addr: int) -> Any:
        return self._ffi.cast("void *", addr)

    def device_count(self) -> int:
        n = self._ffi.new("uint32_t *")
        self._ok("aclrtGetDeviceCount", self._lib.aclrtGetDeviceCount(n))
        return int(n[0])

    def set_device(self, index: int) -> None:
        self._device = index
        self._ok("aclrtSetDevice", self._lib.aclrtSetDevice(index))

    def device_name(self, index: int) -> str:
        soc = self._lib.aclrtGetSocName()
        return self._ffi.string(soc).decode() if soc != self._ffi.NULL else "Ascend NPU"

    def mem_info(self) -> tuple[int, int]:
        free, total = self._ffi.new("size_t *"), self._ffi.new("size_t *")
        self._ok("aclrtGetMemInfo", self._lib.aclrtGetMemInfo(ACL_HBM_MEM, free, total))
        return int(free[0]), int(total[0])

    def malloc(self, nbytes: int) -> int:
        p = self._ffi.new("void **")
        rc = self._lib.aclrtMalloc(p, nbytes, ACL_MEM_MALLOC_HUGE_FIRST)
        if rc != ACL_SUCCESS:
            raise MemoryError(f"aclrtMalloc of {nbytes} B returned aclError {rc}")
        return int(self._ffi.cast("uintptr_t", p[0]))

    def free(self, ptr: int) -> None:
        self._ok("aclrtFree", self._lib.aclrtFree(self._vp(ptr)))

    def host_alloc(self, nbytes: int) -> int:
        p = self._ffi.new("void **")
        rc = self._lib.aclrtMallocHost(p, nbytes)
        if rc != ACL_SUCCESS:
            raise MemoryError(f"aclrtMallocHost of {nbytes} B returned aclError {rc}")
        return int(self._ffi.cast("uintptr_t", p[0]))

    def host_free(self, ptr: int) -> None:
        self._ok("aclrtFreeHost", self._lib.aclrtFreeHost(self._vp(ptr)))

    def host_register(self, ptr: int, nbytes: int) -> None:
        dev = self._ffi.new("void **")
        self._ok(
            "aclrtHostRegister",
            self._lib.aclrtHostRegister(self._vp(ptr), nbytes, ACL_HOST_REGISTER_MAPPED, dev),
        )

    def host_unregister(self, ptr: int) -> None:
        self._ok("aclrtHostUnregister", self._lib.aclrtHostUnregister(self._vp(ptr)))

    def memcpy_async(self, dst: int, src: int, nbytes: int, kind: int, stream: Any) -> None:
        self._ok(
            "aclrtMemcpyAsync",
            self._lib.aclrtMemcpyAsync(self._vp(dst), nbytes, self._vp(src), nbytes, kind, stream),
        )

    def memcpy_batch_async(
        self, dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray, kinds: np.ndarray, stream: Any
    ) -> bool:
        if self._batch_missing:
            return False
        ffi, k = self._ffi, int(dst.size)
        order = np.argsort(kinds, kind="stable")  # one attribute run per direction
        d, s, n, kd = (np.ascontiguousarray(a[order]) for a in (dst, src, nbytes, kinds))
        starts = np.flatnonzero(np.r_[True, kd[1:] != kd[:-1]])
        attrs = ffi.new("aclrtMemcpyBatchAttr[]", len(starts))
        for i, st in enumerate(starts.tolist()):
            kind = int(kd[st])
            attrs[i].srcLoc.type = ACL_MEM_LOCATION_TYPE_DEVICE if kind >= 2 else ACL_MEM_LOCATION_TYPE_HOST
            attrs[i].dstLoc.type = ACL_MEM_LOCATION_TYPE_DEVICE if kind % 2 else ACL_MEM_LOCATION_TYPE_HOST
            attrs[i].srcLoc.id = attrs[i].dstLoc.id = self._device
        idx = np.ascontiguousarray(starts, dtype=np.uint64)
        fail = ffi.new("size_t *")
        try:
            fn = self._lib.aclrtMemcpyBatchAsync
        except AttributeError:
            self._batch_missing = True
            return False
        rc = fn(
            ffi.cast("void **", d.ctypes.data),
            ffi.cast("size_t *", n.ctypes.data),
            ffi.cast("void **", s.ctypes.data),
            ffi.cast("size_t *", n.ctypes.data),
            k,
            attrs,
            ffi.cast("size_t *", idx.ctypes.data),
            len(starts),
            fail,
            stream,
        )
        if rc != ACL_SUCCESS:
            if int(fail[0]) == 2**64 - 1:  # nothing was queued: unsupported here, fall back
                self._batch_missing = True
                return False
            raise AclError(f"aclrtMemcpyBatchAsync (piece {int(fail[0])})", rc)
        return True

    def stream_create(self) -> Any:
        p = self._ffi.new("aclrtStream *")
        self._ok("aclrtCreateStream", self._lib.aclrtCreateStream(p))
        return p[0]

    def stream_destroy(self, stream: Any) -> None:
        self._ok("aclrtDestroyStream", self._lib.aclrtDestroyStream(stream))

    def stream_synchronize(self, stream: Any) -> None:
        self._ok("aclrtSynchronizeStream", self._lib.aclrtSynchronizeStream(stream))

    def stream_query(self, stream: Any) -> bool:
        st = self._ffi.new("int *")
        self._ok("aclrtStreamQuery", self._lib.aclrtStreamQuery(stream, st))
        return st[0] == ACL_STREAM_STATUS_COMPLETE

    def stream_wait_event(self, stream: Any, event: Any) -> None:
        self._ok("aclrtStreamWaitEvent", self._lib.aclrtStreamWaitEvent(stream, event))

    def event_create(self) -> Any:
        p = self._ffi.new("aclrtEvent *")
        self._ok("aclrtCreateEvent", self._lib.aclrtCreateEvent(p))
        return p[0]

    def event_destroy(self, event: Any) -> None:
        self._ok("aclrtDestroyEvent", self._lib.aclrtDestroyEvent(event))

    def external_stream(self, handle: Any) -> Any:
        """An ``aclrtStream`` for a stream ACL made for someone else (torch_npu's
        ``npu_stream`` int, or a cffi pointer), usable wherever this runtime takes one."""
        return self._ffi.cast("aclrtStream", handle)

    def event_record(self, event: Any, stream: Any) -> None:
        self._ok("aclrtRecordEvent", self._lib.aclrtRecordEvent(event, stream))

    def event_synchronize(self, event: Any) -> None:
        self._ok("aclrtSynchronizeEvent", self._lib.aclrtSynchronizeEvent(event))

    def event_query(self, event: Any) -> bool:
        st = self._ffi.new("int *")
        self._ok("aclrtQueryEventStatus", self._lib.aclrtQueryEventStatus(event, st))
        return st[0] == ACL_EVENT_RECORDED_STATUS_COMPLETE

    def ipc_export(self, ptr: int, nbytes: int) -> bytes:
        key = self._ffi.new("char[]", _KEY_LEN)
        self._ok(
            "aclrtIpcMemGetExportKey",
            self._lib.aclrtIpcMemGetExportKey(
                self._vp(ptr), nbytes, key, _KEY_LEN, ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION
            ),
        )
        raw = self._ffi.string(key)
        self._keys[ptr] = raw
        return raw

    def ipc_import(self, payload: bytes, nbytes: int) -> int:
        p = self._ffi.new("void **")
        self._ok(
            "aclrtIpcMemImportByKey",
            self._lib.aclrtIpcMemImportByKey(p, payload, ACL_RT_IPC_MEM_IMPORT_FLAG_ENABLE_PEER_ACCESS),
        )
        return int(self._ffi.cast("uintptr_t", p[0]))

    def ipc_close(self, ptr: int, payload: bytes) -> None:
        self._ok("aclrtIpcMemClose", self._lib.aclrtIpcMemClose(payload))

    def device_tensor(self, ptr: int, nbytes: int, owner: Any) -> Any:
        import torch
        import torch_npu

        device = torch.device(f"npu:{self._device}")
        storage = torch_npu._C._construct_storage_from_data_pointer(ptr, device, nbytes)
        meta = {
            "data_ptr": ptr,
            "device": device,
            "nbytes": nbytes,
            "dtype": torch.uint8,
            "size": (nbytes,),
            "stride": (1,),
            "storage_offset": 0,
        }
        return torch_npu._C._construct_NPU_Tensor_From_Storage_And_Metadata(meta, storage)

    def tensor_device_type(self) -> str:
        return "npu"
