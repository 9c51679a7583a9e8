"""The Ascend platform: the device contract on ACL (``pip install 'kvfabric[ascend]'``).

Importing this package loads neither ACL nor torch_npu; building an
:class:`AscendPlatform` does.
"""

from __future__ import annotations

import sys
from typing import Any

from kvfabric.platform.runtime import DeviceRuntime, RuntimePlatform


class AscendPlatform(RuntimePlatform):
    """Ascend NPUs: aclrtMalloc'd HBM, pinned / registered host memory, ACL IPC export keys."""

    name = "ascend"
    supports_external_streams = True

    def framework_stream(self) -> int | None:
        """torch_npu's current stream on this device as an ``aclrtStream`` address
        (``torch.npu.current_stream(device).npu_stream``); None when torch_npu is not
        loaded or has not initialised the NPU. Reading ``npu_stream`` drains torch_npu's
        task queue (``TASK_QUEUE_ENABLE``) into the ACL stream, so an event recorded right
        after it is behind every kernel the forward launched: read it at record time, never
        cache it. Never imports torch or torch_npu."""
        torch = sys.modules.get("torch")
        npu = getattr(torch, "npu", None) if torch is not None else None
        if npu is None:
            return None
        is_initialized = getattr(npu, "is_initialized", None)
        if is_initialized is not None and not is_initialized():
            return None
        return int(npu.current_stream(self.device).npu_stream)

    def _event_record_external(self, event: Any, stream_handle: Any) -> None:
        convert = getattr(self.runtime, "external_stream", None)
        self.runtime.event_record(event.handle, convert(stream_handle) if convert else stream_handle)

    def _default_runtime(self, device: int) -> DeviceRuntime:
        from kvfabric.platform.ascend.acl import AclRuntime

        try:
            return AclRuntime(device)
        except ImportError as e:
            raise ImportError(
                "the ascend platform needs CANN's libascendcl (source CANN's set_env.sh) and "
                f"torch_npu (pip install 'kvfabric[ascend]'): {e}"
            ) from e


__all__ = ["AscendPlatform"]
