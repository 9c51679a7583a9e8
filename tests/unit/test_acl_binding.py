"""The Ascend backend's ACL binding, driven through cffi against a host-memory build of
the ACL C API (tests/support/fake_acl), with the whole platform contract suite."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from kvf_testing import REPO
from platform_contract import *  # noqa: F403

SRC = REPO / "tests" / "support" / "fake_acl" / "fake_ascendcl.c"


@pytest.fixture(scope="session")
def fake_acl_lib(tmp_path_factory):
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler to build the fake ACL library")
    out = tmp_path_factory.mktemp("fake_acl") / "libascendcl.so"
    subprocess.run([cc, "-O1", "-shared", "-fPIC", "-o", str(out), str(SRC), "-lpthread"], check=True)
    return str(out)


@pytest.fixture
def spec(fake_acl_lib, monkeypatch):
    monkeypatch.setenv("KVFABRIC_ACL_LIB", fake_acl_lib)
    return "ascend-fakelib"


def test_batched_copies_go_through_acl_batch_call(spec):
    from platforms import build

    from kvfabric.platform.types import CopyBatch, Medium

    plat = build(spec)
    try:
        src, dst = plat.alloc(1 << 16, Medium.DRAM), plat.alloc(1 << 16, Medium.HBM)
        back = plat.alloc(1 << 16, Medium.DRAM)
        src.numpy()[:] = 7
        items = [(dst.ptr + i * 64, src.ptr + i * 64, 60) for i in range(100)]
        items += [(back.ptr + i * 64, dst.ptr + i * 64, 60) for i in range(50)]
        plat.batch_copy(CopyBatch.from_items(items))
        assert plat.info().supports_batch_copy  # no fallback to one call per piece
        got = back.numpy()[: 50 * 64].reshape(50, 64)
        assert (got[:, :60] == 7).all() and not got[:, 60:].any()
        assert plat.runtime.name == "ACL (FakeAscend910B)"
    finally:
        plat.close()


def test_library_path_errors_are_clear(monkeypatch):
    from kvfabric.platform.ascend import acl

    monkeypatch.delenv("KVFABRIC_ACL_LIB", raising=False)
    monkeypatch.delenv("ASCEND_TOOLKIT_HOME", raising=False)
    monkeypatch.delenv("ASCEND_HOME_PATH", raising=False)
    if os.path.exists("/usr/local/Ascend"):
        pytest.skip("a CANN install is present")
    monkeypatch.setattr(acl.ctypes.util, "find_library", lambda name: None)
    with pytest.raises(ImportError, match=r"libascendcl\.so not found"):
        acl._library_path()
