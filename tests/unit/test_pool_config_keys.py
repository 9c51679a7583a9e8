import pytest

from kvfabric.pool.config import PoolConfig
from kvfabric.pool.keys import MAX_KEY_BYTES, encode_key, encode_keys


def test_config_defaults_and_sizes(tmp_path):
    c = PoolConfig(dram="64MiB")
    assert c.dram == 64 << 20 and c.socket.endswith("kvfabric-pool-default.sock")
    f = tmp_path / "pool.yaml"
    f.write_text("name: p1\ndram: 1GiB\nhigh_watermark: 0.95\nhttp: 127.0.0.1:0\n")
    c = PoolConfig.from_file(f, dram="2GiB")
    assert (c.name, c.dram, c.high_watermark, c.http_addr) == ("p1", 2 << 30, 0.95, ("127.0.0.1", 0))
    assert c.effective()["token"] == ""


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"dram": "lots"}, "cannot parse size"),
        ({"high_watermark": 0.5, "low_watermark": 0.6}, "watermarks"),
        ({"tcp": "localhost"}, "HOST:PORT"),
        ({"tcp": "127.0.0.1:99999"}, "0..65535"),
        ({"token": "x"}, "only used with tcp"),
        ({"align": 100}, "power of two"),
        ({"name": "a/b"}, "name"),
        ({"write_lease_s": 0}, "write_lease_s"),
        ({"rpc_spin_us": -1}, "rpc_spin_us"),
        ({"rpc_spin_us": 20_000}, "rpc_spin_us"),
    ],
)
def test_config_errors_name_the_key(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PoolConfig(**kwargs)


def test_unknown_keys_are_refused():
    with pytest.raises(ValueError, match="unknown pool config key"):
        PoolConfig.from_mapping({"dramm": 1})


def test_keys():
    assert encode_key("héllo") == "héllo".encode()
    with pytest.raises(ValueError, match="empty"):
        encode_key("")
    with pytest.raises(ValueError, match="longer than 256"):
        encode_key("x" * (MAX_KEY_BYTES + 1))
    encode_key("x" * MAX_KEY_BYTES)
    with pytest.raises(TypeError):
        encode_key(5)
    with pytest.raises(TypeError, match="list of keys"):
        encode_keys("abc")
