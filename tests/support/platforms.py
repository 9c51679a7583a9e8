"""Platform builders by spec string, importable in spawned child processes too.

Specs: ``sim``; ``cuda-fake`` / ``ascend-fake`` (the real CudaPlatform / AscendPlatform
classes on the host-memory runtime of ``fake_runtime.py``); ``ascend-fakelib`` (the real
AclRuntime driving a host-memory build of the ACL C API through cffi); ``cuda`` and
``ascend`` (real hardware).
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import os
from typing import Any

import numpy as np
import pytest

from kvfabric.platform.base import Platform
from kvfabric.platform.types import Medium


def build(spec: str) -> Platform:
    if spec == "sim":
        from kvfabric.platform.sim import SimPlatform

        return SimPlatform()
    if spec in ("cuda-fake", "ascend-fake"):
        from fake_runtime import HostRuntime

        if spec == "cuda-fake":
            from kvfabric.platform.cuda import CudaPlatform as cls
        else:
            from kvfabric.platform.ascend import AscendPlatform as cls
        return cls(runtime=HostRuntime())
    if spec == "ascend-fakelib":
        from kvfabric.platform.ascend import AscendPlatform
        from kvfabric.platform.ascend.acl import AclRuntime

        if not os.environ.get("KVFABRIC_ACL_LIB"):
            raise RuntimeError("ascend-fakelib needs KVFABRIC_ACL_LIB pointing at the fake library")
        return AscendPlatform(runtime=AclRuntime())
    if spec == "cuda":
        from kvfabric.platform.cuda import CudaPlatform

        return CudaPlatform()
    if spec == "ascend":
        from kvfabric.platform.ascend import AscendPlatform

        return AscendPlatform()
    raise ValueError(f"unknown platform spec {spec!r}")


#: what a real-hardware spec needs: (python module, its extra, device node globs, what is absent)
_HARDWARE = {
    "cuda": ("cupy", "cuda", ("/dev/nvidiactl", "/dev/nvidia[0-9]*"), "no NVIDIA GPU on this machine"),
    "ascend": (
        "torch_npu",
        "ascend",
        ("/dev/davinci[0-9]*",),
        "no Ascend NPU on this machine (/dev/davinci* absent)",
    ),
}


def require_hardware(spec: str) -> None:
    """Skip the calling test module (at import) unless ``spec``'s device and SDK are here."""
    module, extra, nodes, absent = _HARDWARE[spec]
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install 'kvfabric[{extra}]')", allow_module_level=True)
    if not any(glob.glob(pattern) for pattern in nodes):
        pytest.skip(absent, allow_module_level=True)


def spec_fixture(spec: str) -> Any:
    """The ``spec`` fixture of a contract module that runs on one platform spec."""

    @pytest.fixture(name="spec")
    def _spec() -> str:
        return spec

    return _spec


def inject_copy_failure(plat: Platform) -> None:
    """Make the next copy submission fail, whatever the backend."""
    faults = getattr(plat, "faults", None)
    if faults is not None:
        faults.fail_copy(nth=1, count=1)
        return
    rt = getattr(plat, "runtime", None)
    if rt is not None and hasattr(rt, "fail_next_copy"):
        rt.fail_next_copy()
        return
    lib = os.environ.get("KVFABRIC_ACL_LIB")
    if lib and type(rt).__name__ == "AclRuntime":
        import ctypes

        ctypes.CDLL(lib).fakeacl_fail_next_copy(1)
        return
    import pytest

    pytest.skip(f"{plat!r} has no fault injection (real hardware)")


def pattern(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def child_write_and_digest(conn, spec: str, handle: bytes, seed: int, env: dict) -> None:
    """Child process: map ``handle``, digest what the parent wrote, then overwrite it with
    ``pattern(n, seed)``; reply with the digest."""
    os.environ.update(env)
    plat = build(spec)
    try:
        win = plat.import_handle(handle)
        host = plat.alloc(win.nbytes, Medium.DRAM)
        plat.copy(host, win)
        digest = hashlib.sha256(host.numpy().tobytes()).hexdigest()
        host.numpy()[:] = pattern(win.nbytes, seed)
        plat.copy(win, host)
        conn.send(("ok", digest))
    except Exception as e:  # noqa: BLE001 - reported to the parent
        conn.send(("error", repr(e)))
    finally:
        plat.close()
        conn.close()
