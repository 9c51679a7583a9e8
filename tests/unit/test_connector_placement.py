"""Where the connector's pool lives and whether an engine's processes can share its store:
``pool_address`` auto / embedded, ``one_process`` from vLLM's parallel config, and the
start-up error for a store of one process in an engine of several."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvfabric.ucm_layer.connector import stores
from kvfabric.ucm_layer.connector.config import load_config


def _vllm(backend: str | None, world: int = 1, dp: int = 1) -> SimpleNamespace:
    pc = SimpleNamespace(distributed_executor_backend=backend, world_size=world, data_parallel_size=dp)
    return SimpleNamespace(parallel_config=pc)


@pytest.mark.parametrize(
    "vllm,one",
    [
        (_vllm("uni"), True),  # TP=1 on a device, or the CPU build with multiprocessing off
        (_vllm(None), True),
        (_vllm("mp"), False),  # the CPU build's default: the worker is a process of its own
        (_vllm("uni", world=2), False),
        (_vllm("mp", world=2), False),
        (_vllm("uni", dp=2), False),
        (SimpleNamespace(), True),
    ],
)
def test_one_process_reads_the_executor(vllm, one):
    assert stores.one_process(vllm) is one


def test_an_unset_pool_address_is_embedded_in_one_process_and_auto_in_several():
    cfg = load_config({"store": "cache|pool"})
    assert cfg.pool_address is None
    assert cfg.placed(one_process=True).pool_address == "embedded"
    assert cfg.placed(one_process=False).pool_address == "auto"
    for given in ("/run/p.sock", "10.0.0.1:7000", "embedded", "auto"):
        assert load_config({"store": "pool", "pool_address": given}).placed(False).pool_address == given
    assert load_config({"store": "cache|posix"}).placed(False).pool_address is None  # no pool
    named = load_config({"store": "pool", "store_options": {"pool.socket": "/x.sock"}})
    assert named.placed(False).pool_address is None  # store_options names the daemon itself


def test_pool_keys_are_checked():
    with pytest.raises(ValueError, match="'auto' or 'embedded'"):
        load_config({"store": "pool", "pool_address": "somewhere"})
    with pytest.raises(ValueError, match="pool_idle_exit_s"):
        load_config({"store": "pool", "pool_idle_exit_s": -1})
    assert load_config({"pool_idle_exit_s": "5"}).pool_idle_exit_s == 5.0


def test_auto_maps_to_the_node_socket_and_embedded_to_a_pool_size(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    auto = load_config({"store": "cache|pool", "pool_address": "auto", "store_options": {"pool.name": "n1"}})
    assert stores.store_config(auto)["pool.socket"] == str(tmp_path / "kvfabric-pool-n1.sock")
    emb = load_config({"store": "cache|pool", "pool_bytes": "64MiB"}).placed(True)
    assert stores.store_config(emb)["pool.embedded_dram"] == 64 << 20


@pytest.mark.parametrize(
    "extra",
    [{"store": "cache"}, {"store": "cache|pool", "pool_address": "embedded"}],
    ids=["cache-alone", "embedded-pool"],
)
def test_a_store_of_one_process_in_an_engine_of_several_is_refused_naming_the_fix(extra):
    cfg = load_config(extra).placed(one_process=False)
    with pytest.raises(ValueError) as e:
        stores.check_shared(cfg, one_process=False)
    msg = str(e.value)
    for fix in ("'cache|pool'", "'cache|posix'", "VLLM_ENABLE_V1_MULTIPROCESSING=0"):
        assert fix in msg
    stores.check_shared(load_config(extra).placed(True), one_process=True)  # one process: fine


@pytest.mark.parametrize("extra", [{"store": "cache|pool"}, {"store": "cache|posix"}, {"store": "pool"}])
def test_shared_stores_pass_in_an_engine_of_several(extra, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    stores.check_shared(load_config({**extra, "posix_path": str(tmp_path)}).placed(False), one_process=False)
