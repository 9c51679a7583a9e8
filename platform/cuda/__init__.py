"""The CUDA platform: the device contract on CUDA through CuPy (``pip install 'kvfabric[cuda]'``).

Importing this package does not import CuPy; building a :class:`CudaPlatform` does.
"""

from __future__ import annotations

import sys
from typing import Any

from kvfabric.platform.runtime import DeviceRuntime, RuntimePlatform


class CudaPlatform(RuntimePlatform):
    """NVIDIA GPUs: cudaMalloc'd HBM, pinned / registered host memory, CUDA IPC handles."""

    name = "cuda"
    supports_external_streams = True

    def framework_stream(self) -> int | None:
        """torch's current CUDA stream on this device as a ``cudaStream_t`` int
        (``torch.cuda.current_stream(device).cuda_stream``); None when torch is not loaded
        or has not initialised CUDA (then it queued no kernels). Never imports torch."""
        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_initialized():
            return None
        return int(torch.cuda.current_stream(self.device).cuda_stream)

    def _event_record_external(self, event: Any, stream_handle: Any) -> None:
        convert = getattr(self.runtime, "external_stream", None)
        self.runtime.event_record(event.handle, convert(stream_handle) if convert else stream_handle)

    def _default_runtime(self, device: int) -> DeviceRuntime:
        from kvfabric.platform.cuda.runtime import CupyRuntime

        try:
            return CupyRuntime(device)
        except ImportError as e:
            raise ImportError(f"the cuda platform needs CuPy: pip install 'kvfabric[cuda]' ({e})") from e


__all__ = ["CudaPlatform"]
