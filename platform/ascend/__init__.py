"""The Ascend platform: the device contract on ACL (``pip install 'kvfabric[ascend]'``).

Importing this package loads neither ACL nor torch_npu; building an
:class:`AscendPlatform` does.
"""

from __future__ import annotations

from kvfabric.platform.runtime import DeviceRuntime, RuntimePlatform


class AscendPlatform(RuntimePlatform):
    """Ascend NPUs: aclrtMalloc'd HBM, pinned / registered host memory, ACL IPC export keys."""

    name = "ascend"

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
