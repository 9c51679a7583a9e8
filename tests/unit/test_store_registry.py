"""The store registry: specs, one flat config validated per store, lazy imports."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from kvfabric.platform.checksum import Verify
from kvfabric.platform.sim import SimPlatform
from kvfabric.ucm_layer.store import registry
from kvfabric.ucm_layer.store.base import StoreLayout, check_addrs, check_ids
from kvfabric.ucm_layer.store.cache import CacheStore
from kvfabric.ucm_layer.store.config import as_paths, describe
from kvfabric.ucm_layer.store.pipeline import Pipeline, PipelineConfig
from kvfabric.ucm_layer.store.posix import PosixConfig, PosixStore

LAYOUT = StoreLayout((1024, 512))


@pytest.fixture
def plat():
    p = SimPlatform()
    yield p
    p.close()


def test_specs():
    assert registry.parse_spec("posix") == ("posix",)
    assert registry.parse_spec(" cache | posix ") == ("cache", "posix")
    for bad, msg in [
        ("", "store spec must be"),
        ("nfs", "unknown store 'nfs'"),
        ("posix|cache", "only a caching tier"),
        ("cache|cache", "names a store twice"),
        ("cache|posix|posix", "twice"),
    ]:
        with pytest.raises(ValueError, match=msg):
            registry.parse_spec(bad)
    assert {"posix", "cache"} <= set(registry.available())


def test_create_from_one_flat_mapping(tmp_path, plat):
    cfg = {
        "store": "cache|posix",
        "posix.dirs": str(tmp_path),
        "cache.capacity": "1MiB",
        "pipeline.write": "behind",
    }
    with registry.create(config=cfg, layout=LAYOUT, platform=plat) as p:
        assert isinstance(p, Pipeline) and p.name == "cache|posix"
        assert isinstance(p.upper, CacheStore) and isinstance(p.lower, PosixStore)
        assert p.config == PipelineConfig(write="behind") and p.upper.table.size == (1 << 20) // 1536
        assert p.upper.verify is Verify.ON and p.lower.verify is Verify.ON  # the default
    off = {**cfg, "posix.verify": "off", "cache.verify": False}
    with registry.create(config=off, layout=LAYOUT, platform=plat) as p:
        assert p.upper.verify is Verify.OFF and p.lower.verify is Verify.OFF
    with registry.create("posix", {"posix.dirs": [str(tmp_path)]}, layout=LAYOUT, platform=plat) as s:
        assert isinstance(s, PosixStore)


@pytest.mark.parametrize(
    "spec,cfg,msg",
    [
        (
            "posix",
            {"posix.dirs": "/nonexistent/kvf-test", "cache.capacity": "1GiB"},
            "'cache.capacity' is for 'cache'",
        ),
        (
            "posix",
            {"posix.dirs": "/nonexistent/kvf-test", "pipeline.write": "behind"},
            "'pipeline.write' is for 'pipeline'",
        ),
        (
            "posix",
            {"posix.dirs": "/nonexistent/kvf-test", "nfs.server": "a"},
            "unknown config key 'nfs.server'",
        ),
        ("posix", {"posix.dirs": "/nonexistent/kvf-test", "capacity": 1}, "is not '<store>.<name>'"),
        (
            "posix",
            {"posix.dirs": "/nonexistent/kvf-test", "posix.capasity": 1},
            r"unknown config key\(s\) posix\.capasity",
        ),
        ("posix", {}, r"posix\.dirs is required"),
        ("cache", {"cache.capacity": "a lot"}, r"bad value for config key cache\.capacity"),
        (
            "cache|posix",
            {"posix.dirs": "/nonexistent/kvf-test", "cache.capacity": 1 << 20, "pipeline.write": "later"},
            "through",
        ),
        ("posix", {"store": "cache", "posix.dirs": "/nonexistent/kvf-test"}, "disagrees"),
        (
            "posix",
            {"posix.dirs": "/nonexistent/kvf-test", "posix.verify": "maybe"},
            r"bad value for config key posix\.verify='maybe': expected one of on, off",
        ),
        ("cache", {"cache.capacity": 1 << 20, "cache.verify": 2}, r"config key cache\.verify"),
        ("pool", {"pool.verify": "sometimes"}, r"config key pool\.verify"),
    ],
)
def test_config_errors_name_the_key(plat, spec, cfg, msg):
    with pytest.raises(ValueError, match=msg):
        registry.create(spec, cfg, layout=LAYOUT, platform=plat)
    assert not __import__("os").path.exists("/nonexistent")  # nothing was built


def test_no_spec_is_an_error(plat):
    with pytest.raises(ValueError, match="no store spec"):
        registry.create(config={}, layout=LAYOUT, platform=plat)


def test_register_validates_and_imports_lazily():
    with pytest.raises(ValueError, match="identifier"):
        registry.register("a|b", "x:Y")
    with pytest.raises(ValueError, match=r"package\.module:Class"):
        registry.register("thing", "no_colon")
    registry.register("bogus", "kvfabric.errors:KVFabricError")
    try:
        with pytest.raises(ImportError, match="is not a Store class"):
            registry.store_class("bogus")
        registry.register("absent", "kvfabric.ucm_layer.store.nowhere:Nothing")
        with pytest.raises(ImportError, match="failed to import"):
            registry.store_class("absent")
    finally:
        registry.STORES.unregister("bogus")
        registry.STORES.unregister("absent")
    code = (
        "import sys, kvfabric.ucm_layer.store.registry as r\n"
        "print(sorted(m for m in sys.modules if m.startswith('kvfabric.ucm_layer.store.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "posix" not in out and "cache" not in out and "pipeline" not in out


def test_config_parsers_and_docs():
    assert as_paths("/a, /b") == ("/a", "/b")
    with pytest.raises(ValueError, match="at least one"):
        as_paths("")
    rows = describe("posix", PosixConfig)
    assert rows[0][0] == "posix.dirs" and rows[0][1] == "required"


def test_argument_checks():
    with pytest.raises(ValueError, match=r"\(n, 16\) uint8"):
        check_ids(np.zeros((2, 16), np.int8))
    with pytest.raises(ValueError, match=r"shape \(2, 2\)"):
        check_addrs(np.zeros((2, 3), np.uint64), 2, LAYOUT)
    with pytest.raises(ValueError, match="non-negative"):
        check_addrs(np.full((2, 2), -1), 2, LAYOUT)
    assert check_addrs(np.zeros(2, np.int64), 2, StoreLayout((8,))).shape == (2, 1)
    with pytest.raises(ValueError, match="positive byte counts"):
        StoreLayout((1, 0))
    with pytest.raises(TypeError, match="sequence of ints"):
        StoreLayout(("a",))
    with pytest.raises(ValueError, match="num_shards"):
        StoreLayout((1,), num_shards=0)
    assert LAYOUT.offsets.tolist() == [0, 1024] and LAYOUT.shard_bytes == 1536
