import importlib
import sys

import pytest

from kvfabric.platform import registry
from kvfabric.platform.sim import SimPlatform


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv("KVFABRIC_PLATFORM", raising=False)


def test_explicit_name_beats_environment(monkeypatch):
    monkeypatch.setenv("KVFABRIC_PLATFORM", "cuda")
    assert registry.resolve_name("sim") == "sim"
    assert registry.resolve_name() == "cuda"


def test_detection_falls_back_to_sim_here():
    # this CI machine has neither /dev/davinci* with torch_npu nor an NVIDIA GPU with CuPy
    assert registry.detect() == "sim"
    assert registry.resolve_name() == "sim"
    p = registry.create()
    assert isinstance(p, SimPlatform)
    p.close()


def test_unknown_names_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="unknown platform 'tpu'"):
        registry.resolve_name("tpu")
    monkeypatch.setenv("KVFABRIC_PLATFORM", "tpu")
    with pytest.raises(ValueError, match="known: ascend, cuda, sim"):
        registry.create()


def test_missing_sdk_names_the_extra():
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed here")
    with pytest.raises(ImportError, match=r"kvfabric\[cuda\]"):
        registry.create("cuda")


def test_entry_point_plugins_are_found(tmp_path, monkeypatch):
    pkg = tmp_path / "kvf_plugin_demo.py"
    pkg.write_text(
        "from kvfabric.platform.sim import SimPlatform\nclass DemoPlatform(SimPlatform):\n    name = 'demo'\n"
    )
    dist = tmp_path / "kvf_plugin_demo-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kvf-plugin-demo\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        f"[{registry.ENTRY_POINT_GROUP}]\ndemo = kvf_plugin_demo:DemoPlatform\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert registry.available()["demo"] == "kvf_plugin_demo:DemoPlatform"
    p = registry.create("demo")
    try:
        assert type(p).__name__ == "DemoPlatform" and p.name == "demo"
    finally:
        p.close()
        sys.modules.pop("kvf_plugin_demo", None)


def test_register_guards_builtins():
    with pytest.raises(ValueError, match="built in"):
        registry.register("sim", "x:Y")
    with pytest.raises(ValueError, match="module:Class"):
        registry.register("x", "nocolon")


def test_default_platform_is_shared_and_recreated_after_close():
    a = registry.default()
    assert registry.default() is a
    a.close()
    b = registry.default()
    assert b is not a
    b.close()
