"""``CupyRuntime``: the :class:`~kvfabric.platform.runtime.DeviceRuntime` on CUDA via CuPy.

CuPy is imported when the runtime is built, never at module import. Batched copies run
one small CUDA kernel (one thread block per piece, 16-byte accesses when aligned) instead
of one ``cudaMemcpyAsync`` launch per piece; it needs every host end to be device-mapped
(pinned by ``cudaHostAlloc`` or registered with ``cudaHostRegisterMapped``), which holds
for every buffer this platform hands out or registers.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

import numpy as np

_KERNEL = r"""
extern "C" __global__ void kvf_batch_copy(const unsigned long long* dst,
                                          const unsigned long long* src,
                                          const unsigned long long* n, long long k) {
    long long piece = blockIdx.x;
    if (piece >= k) return;
    char* d = (char*)dst[piece];
    const char* s = (const char*)src[piece];
    unsigned long long len = n[piece];
    if ((((unsigned long long)d | (unsigned long long)s | len) & 15ULL) == 0ULL) {
        uint4* d4 = (uint4*)d;
        const uint4* s4 = (const uint4*)s;
        for (unsigned long long i = threadIdx.x; i < (len >> 4); i += blockDim.x) d4[i] = s4[i];
    } else {
        for (unsigned long long i = threadIdx.x; i < len; i += blockDim.x) d[i] = s[i];
    }
}
"""

_HOST_ALLOC_PORTABLE_MAPPED = 0x01 | 0x02  # cudaHostAllocPortable | cudaHostAllocMapped
_HOST_REGISTER_PORTABLE_MAPPED = 0x01 | 0x02  # cudaHostRegisterPortable | cudaHostRegisterMapped
_IPC_LAZY_ENABLE_PEER_ACCESS = 0x01
_STREAM_NON_BLOCKING = 0x01
_EVENT_DISABLE_TIMING = 0x02


class CupyRuntime:
    """CUDA runtime calls through ``cupy.cuda.runtime`` (see module docstring)."""

    def __init__(self, device: int = 0) -> None:
        import cupy

        self._cp = cupy
        self._rt = cupy.cuda.runtime
        self._device = device
        self._kernel: Any = None
        self._lock = threading.Lock()
        self._inflight: deque[tuple[Any, Any]] = deque()
        ver = self._rt.runtimeGetVersion()
        self.name = f"CUDA runtime {ver // 1000}.{ver % 1000 // 10} via CuPy {cupy.__version__}"

    def device_count(self) -> int:
        return int(self._rt.getDeviceCount())

    def set_device(self, index: int) -> None:
        self._device = index
        self._rt.setDevice(index)

    def device_name(self, index: int) -> str:
        name = self._rt.getDeviceProperties(index)["name"]
        return name.decode() if isinstance(name, bytes) else str(name)

    def mem_info(self) -> tuple[int, int]:
        free, total = self._rt.memGetInfo()
        return int(free), int(total)

    def malloc(self, nbytes: int) -> int:
        return int(self._rt.malloc(nbytes))

    def free(self, ptr: int) -> None:
        self._rt.free(ptr)

    def host_alloc(self, nbytes: int) -> int:
        return int(self._rt.hostAlloc(nbytes, _HOST_ALLOC_PORTABLE_MAPPED))

    def host_free(self, ptr: int) -> None:
        self._rt.freeHost(ptr)

    def host_register(self, ptr: int, nbytes: int) -> None:
        self._rt.hostRegister(ptr, nbytes, _HOST_REGISTER_PORTABLE_MAPPED)

    def host_unregister(self, ptr: int) -> None:
        self._rt.hostUnregister(ptr)

    def memcpy_async(self, dst: int, src: int, nbytes: int, kind: int, stream: Any) -> None:
        self._rt.memcpyAsync(dst, src, nbytes, 4, stream)  # cudaMemcpyDefault: UVA infers it

    def memcpy_batch_async(
        self, dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray, kinds: np.ndarray, stream: Any
    ) -> bool:
        cp = self._cp
        if self._kernel is None:
            self._kernel = cp.RawKernel(_KERNEL, "kvf_batch_copy")
        k = int(dst.size)
        table = np.ascontiguousarray(np.stack([dst, src, nbytes]), dtype=np.uint64)
        with cp.cuda.ExternalStream(stream):
            dev_table = cp.asarray(table)  # H2D on the same stream, ordered before the kernel
            self._kernel((k,), (256,), (dev_table[0], dev_table[1], dev_table[2], np.int64(k)))
        # The address table must outlive the kernel: keep it until an event behind it fires.
        ev = self._rt.eventCreateWithFlags(_EVENT_DISABLE_TIMING)
        self._rt.eventRecord(ev, stream)
        with self._lock:
            self._inflight.append((ev, dev_table))
            while self._inflight and self._rt.eventQuery(self._inflight[0][0]) == 0:
                done, _ = self._inflight.popleft()
                self._rt.eventDestroy(done)
        return True

    def stream_create(self) -> Any:
        return self._rt.streamCreateWithFlags(_STREAM_NON_BLOCKING)

    def stream_destroy(self, stream: Any) -> None:
        self._rt.streamDestroy(stream)

    def stream_synchronize(self, stream: Any) -> None:
        self._rt.streamSynchronize(stream)

    def stream_query(self, stream: Any) -> bool:
        return self._rt.streamQuery(stream) == 0

    def stream_wait_event(self, stream: Any, event: Any) -> None:
        self._rt.streamWaitEvent(stream, event, 0)

    def event_create(self) -> Any:
        return self._rt.eventCreateWithFlags(_EVENT_DISABLE_TIMING)

    def event_destroy(self, event: Any) -> None:
        self._rt.eventDestroy(event)

    def external_stream(self, handle: Any) -> int:
        """A ``cudaStream_t`` another library made (torch's ``cuda_stream`` int): as is."""
        return int(handle)

    def event_record(self, event: Any, stream: Any) -> None:
        self._rt.eventRecord(event, stream)

    def event_synchronize(self, event: Any) -> None:
        self._rt.eventSynchronize(event)

    def event_query(self, event: Any) -> bool:
        return self._rt.eventQuery(event) == 0

    def ipc_export(self, ptr: int, nbytes: int) -> bytes:
        return bytes(self._rt.ipcGetMemHandle(ptr))

    def ipc_import(self, payload: bytes, nbytes: int) -> int:
        return int(self._rt.ipcOpenMemHandle(payload, _IPC_LAZY_ENABLE_PEER_ACCESS))

    def ipc_close(self, ptr: int, payload: bytes) -> None:
        self._rt.ipcCloseMemHandle(ptr)

    def device_tensor(self, ptr: int, nbytes: int, owner: Any) -> Any:
        import torch

        cp = self._cp
        mem = cp.cuda.UnownedMemory(ptr, nbytes, owner, device_id=self._device)
        arr = cp.ndarray((nbytes,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(mem, 0))
        return torch.as_tensor(arr, device=f"cuda:{self._device}")

    def tensor_device_type(self) -> str:
        return "cuda"
