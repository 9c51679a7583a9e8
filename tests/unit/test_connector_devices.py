"""ucm_layer/connector/devices.py: the worker's device index, a platform bound to it, and
the event that orders dumps after the forward (sim here; the device paths skip without
their hardware)."""

from __future__ import annotations

import glob
import importlib.util
import os

import pytest

from kvfabric.platform import registry
from kvfabric.platform.sim import SimPlatform
from kvfabric.ucm_layer.connector import devices


@pytest.fixture
def clean_env(monkeypatch):
    for var in ("LOCAL_RANK", *devices.VISIBLE_DEVICE_VARS):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_local_device_index_defaults_to_zero(clean_env):
    assert devices.local_device_index() == 0


def test_local_device_index_from_local_rank(clean_env):
    clean_env.setenv("LOCAL_RANK", "3")
    assert devices.local_device_index() == 3


def test_local_rank_is_an_index_within_the_visible_devices(clean_env):
    clean_env.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    clean_env.setenv("LOCAL_RANK", "1")
    assert devices.local_device_index() == 1
    clean_env.setenv("CUDA_VISIBLE_DEVICES", "5")  # pinned to one device: that one is 0
    clean_env.setenv("LOCAL_RANK", "1")
    assert devices.local_device_index() == 0
    clean_env.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    clean_env.setenv("LOCAL_RANK", "2")
    with pytest.raises(ValueError, match="only 2 devices are visible"):
        devices.local_device_index()


@pytest.mark.parametrize("bad", ["x", "-1"])
def test_malformed_local_rank_is_refused(clean_env, bad):
    clean_env.setenv("LOCAL_RANK", bad)
    with pytest.raises(ValueError, match="LOCAL_RANK"):
        devices.local_device_index()


def test_vllm_world_group_comes_first(clean_env):
    """Inside an initialised vLLM worker the world group's device wins over LOCAL_RANK."""
    pytest.importorskip("vllm.distributed.parallel_state", reason="vLLM is not installed")
    import torch
    from vllm.distributed import parallel_state

    class World:  # the two attributes of GroupCoordinator that are read
        local_rank = 1
        device = torch.device("cuda", 2)

    clean_env.setenv("LOCAL_RANK", "5")
    clean_env.setattr(parallel_state, "_WORLD", World())
    assert devices.local_device_index() == 2
    World.device = torch.device("cpu")  # no device index on the group: its local rank
    assert devices.local_device_index() == 1


def test_worker_platform_on_device_one_is_not_the_default(clean_env):
    clean_env.setenv("KVFABRIC_PLATFORM", "sim")
    clean_env.setattr(registry, "_default", None)  # this test's own singleton, restored after
    plat = devices.worker_platform("sim", 1)
    try:
        assert isinstance(plat, SimPlatform) and plat.device == 1
        assert registry._default is None  # worker_platform neither creates nor replaces it
        default = registry.default()
        try:
            assert default is not plat and default.device == 0
            assert registry.default() is default
            plat.close()
            assert registry.default() is default and not default.closed
        finally:
            default.close()
    finally:
        plat.close()


@pytest.mark.parametrize("bad", [-1, True, 1.0])
def test_worker_platform_rejects_bad_indices(bad):
    with pytest.raises(ValueError, match="device_index"):
        devices.worker_platform("sim", bad)


def test_compute_done_event_is_none_on_sim(plat):
    assert devices.compute_done_event(plat) is None
    assert devices.compute_done_event(plat, tensor=object()) is None


def test_compute_done_event_is_none_for_host_tensors_and_uninitialised_torch():
    """A device platform whose framework has no device work to order after gives None
    (the cuda-fake platform: the real CudaPlatform class on a host-memory runtime)."""
    torch = pytest.importorskip("torch")
    from fake_runtime import HostRuntime

    from kvfabric.platform.cuda import CudaPlatform

    plat = CudaPlatform(runtime=HostRuntime())
    try:
        assert devices.compute_done_event(plat, torch.zeros(4)) is None
        if not torch.cuda.is_initialized():
            assert devices.compute_done_event(plat) is None
    finally:
        plat.close()


def _event_after_a_kernel(torch, platform: str, device: int) -> None:
    """A kernel on the framework's current stream, then the event: it completes."""
    plat = devices.worker_platform(platform, device)
    try:
        kind = "npu" if platform == "ascend" else "cuda"
        x = torch.ones(1 << 20, device=f"{kind}:{plat.device}") * 3
        ev = devices.compute_done_event(plat, x)
        assert ev is not None
        ev.synchronize()
        assert ev.query()
    finally:
        plat.close()


def test_compute_done_event_on_cuda():
    torch = pytest.importorskip("torch")
    pytest.importorskip("cupy", reason="the cuda platform needs CuPy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device for torch")
    _event_after_a_kernel(torch, "cuda", torch.cuda.current_device())


def test_compute_done_event_on_ascend():
    if importlib.util.find_spec("torch_npu") is None:
        pytest.skip("torch_npu is not installed")
    if not (glob.glob("/dev/davinci[0-9]*") or os.environ.get("ASCEND_RT_VISIBLE_DEVICES")):
        pytest.skip("no Ascend NPU on this machine")
    import torch
    import torch_npu  # noqa: F401

    _event_after_a_kernel(torch, "ascend", torch.npu.current_device())
