import numpy as np
import pytest

from kvfabric.platform import native


@pytest.fixture(params=["native", "ctypes"])
def helpers(request):
    if request.param == "ctypes":
        return native.CtypesNative()
    h = native.get()
    if not isinstance(h, native.Native):
        pytest.skip("no C compiler here: the compiled helpers are unavailable")
    return h


def test_memcpy_batch_gather_scatter(helpers):
    src = np.arange(1000, dtype=np.uint8)
    dst = np.zeros(1000, np.uint8)
    base_s, base_d = src.ctypes.data, dst.ctypes.data
    helpers.memcpy_batch(
        np.array([base_d + 10, base_d + 500], np.uint64),
        np.array([base_s + 0, base_s + 100], np.uint64),
        np.array([5, 7], np.uint64),
    )
    assert dst[10:15].tolist() == list(range(5)) and dst[500:507].tolist() == list(range(100, 107))
    out = np.zeros(12, np.uint8)
    n = helpers.gather(
        out.ctypes.data, np.array([base_s + 1, base_s + 50], np.uint64), np.array([4, 8], np.uint64)
    )
    assert n == 12 and out.tolist() == [1, 2, 3, 4, *range(50, 58)]
    back = np.zeros(1000, np.uint8)
    helpers.scatter(
        np.array([back.ctypes.data + 900, back.ctypes.data], np.uint64),
        out.ctypes.data,
        np.array([4, 8], np.uint64),
    )
    assert back[900:904].tolist() == [1, 2, 3, 4] and back[:8].tolist() == list(range(50, 58))


def test_atomics(helpers):
    cell = np.zeros(2, np.uint64)
    addr = cell.ctypes.data
    helpers.store_release(addr, 41)
    assert helpers.fetch_add(addr, 1) == 41 and helpers.load_acquire(addr) == 42
    assert helpers.cas(addr, 42, 7) and not helpers.cas(addr, 42, 8)
    assert int(cell[0]) == 7
    helpers.fetch_add(addr + 8, -1)
    assert int(cell[1]) == 2**64 - 1
    helpers.fence()
    helpers.fence_acquire()
    helpers.fence_release()


def test_fallback_when_disabled(monkeypatch):
    monkeypatch.setenv("KVFABRIC_NATIVE", "0")
    monkeypatch.setattr(native, "_cached", None)
    assert isinstance(native.get(), native.CtypesNative)
    monkeypatch.setattr(native, "_cached", None)
