"""The CUDA platform: the device contract on CUDA through CuPy (``pip install 'kvfabric[cuda]'``).

Importing this package does not import CuPy; building a :class:`CudaPlatform` does.
"""

from __future__ import annotations

from kvfabric.platform.runtime import DeviceRuntime, RuntimePlatform


class CudaPlatform(RuntimePlatform):
    """NVIDIA GPUs: cudaMalloc'd HBM, pinned / registered host memory, CUDA IPC handles."""

    name = "cuda"

    def _default_runtime(self, device: int) -> DeviceRuntime:
        from kvfabric.platform.cuda.runtime import CupyRuntime

        try:
            return CupyRuntime(device)
        except ImportError as e:
            raise ImportError(f"the cuda platform needs CuPy: pip install 'kvfabric[cuda]' ({e})") from e


__all__ = ["CudaPlatform"]
