import numpy as np
import pytest

from kvfabric.pool.config import PoolConfig
from kvfabric.pool.keys import (
    MAX_KEY_BYTES,
    as_u64,
    check_ints,
    check_keys,
    check_lengths,
    check_sizes,
    encode_key,
    encode_keys,
)


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


def test_service_key_checks_name_the_first_bad_index():
    check_keys([b"a", "é".encode(), b"x" * MAX_KEY_BYTES])
    check_keys([])
    for keys, match in [
        ([b"ok", b""], r"keys\[1\]: pool keys must not be empty"),
        ([b"ok", b"x" * (MAX_KEY_BYTES + 1)], r"keys\[1\]: pool key of 257 bytes"),
        ([b"ok", b"\xff\xfe-service"], r"keys\[1\]: .*reserved"),
        ([b"ok", "text"], r"keys\[1\]: pool keys are bytes on the wire, got str"),
    ]:
        with pytest.raises(ValueError, match=match):
            check_keys(keys)
    with pytest.raises(ValueError, match="must be a list"):
        check_keys(b"abc")
    with pytest.raises(ValueError, match="2 keys but 1 sizes"):
        check_lengths("keys", [b"a", b"b"], sizes=[1])


def test_sizes_and_ids():
    assert check_sizes([1, 2]) == [1, 2]
    assert check_ints([np.uint64(3)], "gvas") == [3]
    for values, match in [
        ([4, -1], r"sizes\[1\] = -1: must be > 0"),
        ([0], r"sizes\[0\] = 0: must be > 0"),
        ([1.0], r"sizes\[0\] = 1.0: must be an integer"),
        ([True], r"sizes\[0\] = True: must be an integer"),
        ([1 << 64], r"sizes\[0\] = 18446744073709551616: must be <= "),
    ]:
        with pytest.raises(ValueError, match=match):
            check_sizes(values)
    with pytest.raises(ValueError, match=r"sizes\[0\] = 9: must be <= 8"):
        check_sizes([9], hi=8)


@pytest.mark.parametrize(
    "values,positive,match",
    [
        ([1, 2, 3, -1], True, r"sizes\[3\] = -1: must be > 0"),
        (np.array([5, -2], np.int64), False, r"sizes\[1\] = -2: must be >= 0"),
        (np.array([[1, 2], [3, 0]], np.uint32), True, r"sizes\[3\] = 0: must be > 0"),
        ([1.5], False, r"sizes\[0\] = 1.5: must be an integer"),
        (np.array([2.0]), False, r"sizes\[0\] = 2.0: must be an integer"),
        ([1, 1 << 64], False, r"sizes\[1\] = 18446744073709551616: must be <="),
        (["12"], False, r"sizes\[0\] = '12': must be an integer"),
    ],
)
def test_as_u64_refuses_what_numpy_would_wrap_or_truncate(values, positive, match):
    with pytest.raises(ValueError, match=match):
        as_u64(values, "sizes", positive)


def test_as_u64_keeps_good_values():
    big = (1 << 64) - 1
    assert as_u64([0, 1 << 63, big], "ptrs").tolist() == [0, 1 << 63, big]
    a = np.arange(6, dtype=np.uint64).reshape(2, 3)
    out = as_u64(a, "ptrs")
    assert out.dtype == np.uint64 and out.shape == (6,) and out.flags.c_contiguous
    assert as_u64(7, "ptr").tolist() == [7]
