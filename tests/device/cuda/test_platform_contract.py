"""The platform contract on a real NVIDIA GPU (skipped without one, or without CuPy)."""

import pytest
from platforms import require_hardware, spec_fixture

require_hardware("cuda")

from platform_contract import *  # noqa: E402, F403

spec = spec_fixture("cuda")


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


def test_event_on_torch_current_stream_orders_a_platform_copy():
    """compute_done_event records on torch's current stream: a platform stream waiting on
    it copies what a slow torch kernel wrote, with no host synchronize in between."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA build here")
    from kvfabric.platform.cuda import CudaPlatform
    from kvfabric.platform.types import Medium
    from kvfabric.ucm_layer.connector.devices import compute_done_event

    device = torch.cuda.device_count() - 1  # the last device: not the default 0 when there are two
    torch.cuda.set_device(device)
    plat = CudaPlatform(device=device)
    try:
        src = torch.zeros(1 << 20, dtype=torch.uint8, device=f"cuda:{device}")
        torch.cuda.synchronize()
        assert plat.framework_stream() == torch.cuda.current_stream(device).cuda_stream
        torch.cuda._sleep(50_000_000)  # keep the stream busy, then write
        src.fill_(7)
        ev = compute_done_event(plat, src)
        assert ev is not None and not ev.query()
        dev_buf, host = plat.wrap(src), plat.alloc(src.numel(), Medium.DRAM)
        s = plat.stream()
        s.wait_event(ev)
        plat.copy(host, dev_buf, stream=s)
        s.synchronize()
        assert (host.numpy() == 7).all()
    finally:
        plat.close()
