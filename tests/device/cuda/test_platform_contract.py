"""The platform contract on a real NVIDIA GPU (skipped without one, or without CuPy)."""

import glob
import importlib.util
import os

import pytest
from platform_contract import *  # noqa: F403

if importlib.util.find_spec("cupy") is None:
    pytest.skip("CuPy is not installed (pip install 'kvfabric[cuda]')", allow_module_level=True)
if not (os.path.exists("/dev/nvidiactl") or glob.glob("/dev/nvidia[0-9]*")):
    pytest.skip("no NVIDIA GPU on this machine", allow_module_level=True)


@pytest.fixture
def spec():
    return "cuda"


def test_batched_copy_uses_one_kernel_launch():
    """Many small pieces go through the copy kernel, not one memcpy per piece."""
    from platforms import build

    from kvfabric.platform.types import CopyBatch, Medium

    plat = build("cuda")
    try:
        src, dst = plat.alloc(1 << 20, Medium.DRAM), plat.alloc(1 << 20, Medium.HBM)
        src.numpy()[:] = 5
        plat.batch_copy(
            CopyBatch.from_items([(dst.ptr + i * 1024, src.ptr + i * 1024, 1000) for i in range(1024)])
        )
        assert plat.info().supports_batch_copy
        t = dst.tensor().cpu().numpy()
        assert (t.reshape(1024, 1024)[:, :1000] == 5).all()
    finally:
        plat.close()
