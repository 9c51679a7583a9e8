"""Config files are validated key by key with types: every field of PoolConfig, GvaConfig
and the connector's config refuses a value of the wrong type with an error naming the key
and what was expected (fields added later are covered by their annotation), and unknown
keys are refused with the sorted list of the known ones."""

from __future__ import annotations

import dataclasses

import pytest

from kvfabric.pool.config import PoolConfig
from kvfabric.pool.gva.config import GvaConfig, PairRule
from kvfabric.settings import Size, coerce_fields
from kvfabric.ucm_layer.connector.config import ConnectorConfig, load_config
from kvfabric.ucm_layer.store.posix import PosixConfig


class _Odd:
    def __repr__(self) -> str:
        return "<odd>"


@pytest.mark.parametrize("cls", [PoolConfig, GvaConfig, ConnectorConfig])
def test_every_field_refuses_a_value_of_the_wrong_type_naming_it(cls):
    base = {"store": "posix"} if cls is ConnectorConfig else {}
    for f in dataclasses.fields(cls):
        with pytest.raises(ValueError, match=rf"{f.name}\W*=<odd>: expected "):
            cls(**{**base, f.name: _Odd()})


@pytest.mark.parametrize("text", ["maybe", "2", "", "truthy"])
def test_pretouch_maybe_is_not_a_boolean(text):
    with pytest.raises(ValueError, match=r"pool config pretouch=.*expected a boolean"):
        PoolConfig(pretouch=text)


@pytest.mark.parametrize(
    "value,want",
    [
        (True, True),
        (False, False),
        ("on", True),
        ("OFF", False),
        (" Yes ", True),
        ("no", False),
        ("1", True),
        (0, False),
    ],
)
def test_booleans_from_bools_and_their_words(value, want):
    assert PoolConfig(pretouch=value).pretouch is want


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"max_objects": "lots"}, "max_objects='lots': expected an integer"),
        ({"max_objects": 2.5}, "max_objects=2.5: expected an integer"),
        ({"write_lease_s": "soon"}, "write_lease_s='soon': expected a number"),
        ({"write_lease_s": float("nan")}, "write_lease_s=nan: expected a finite number"),
        ({"read_lease_s": True}, "read_lease_s=True: expected a number"),
        ({"dram": True}, "dram=True: expected a size in bytes"),
        ({"dram": "-1GiB"}, "dram='-1GiB': expected a size in bytes"),
        ({"token": 12345, "tcp": "127.0.0.1:0"}, "token=12345: expected a string"),
        ({"name": None}, "name=None: expected a string"),
    ],
)
def test_wrong_types_name_the_key_and_what_was_expected(kwargs, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        PoolConfig(**kwargs)


def test_text_of_numbers_and_sizes_is_converted():
    c = PoolConfig(dram="64MiB", max_objects="8_192", high_watermark="0.95", write_lease_s="12")
    assert (c.dram, c.max_objects, c.high_watermark, c.write_lease_s) == (64 << 20, 8192, 0.95, 12.0)


def test_yaml_file_is_checked_key_by_key(tmp_path):
    f = tmp_path / "pool.yaml"
    f.write_text("name: p\npretouch: maybe\n")
    with pytest.raises(ValueError, match="pool config pretouch='maybe': expected a boolean"):
        PoolConfig.from_file(f)
    f.write_text("name: p\npretouch: off\ndram: 1GiB\nrpc_spin_us: 50\n")
    c = PoolConfig.from_file(f)
    assert (c.pretouch, c.dram, c.rpc_spin_us) == (False, 1 << 30, 50.0)
    f.write_text("name: p\nprettouch: true\nzz: 1\n")
    known = sorted(x.name for x in dataclasses.fields(PoolConfig))
    with pytest.raises(ValueError, match="unknown pool config key") as e:
        PoolConfig.from_file(f)
    assert str(e.value).endswith(f"['prettouch', 'zz']; known: {known}")
    f.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="must be a mapping"):
        PoolConfig.from_file(f)


def test_gva_config_types_and_unknown_keys():
    c = GvaConfig.from_mapping({"transports": "mapped, remote", "alignment": "64", "heartbeat_ttl": 2})
    assert (c.transports, c.alignment, c.heartbeat_ttl) == (("mapped", "remote"), 64, 2.0)
    with pytest.raises(ValueError, match=r"unknown GvaConfig key\(s\) \['transport'\]; known: \['alignment'"):
        GvaConfig.from_mapping({"transport": "mapped"})
    with pytest.raises(ValueError, match=r"GvaConfig\.pair_rules=.*a list of PairRule"):
        GvaConfig(pair_rules=[{"src": 1}])
    with pytest.raises(ValueError, match=r"GvaConfig\.copy_streams='two': expected an integer"):
        GvaConfig(copy_streams="two")
    with pytest.raises(ValueError, match=r"PairRule\.src='x': expected an integer or null"):
        PairRule("x", None, ("mapped",))


def test_connector_config_types():
    with pytest.raises(ValueError, match="'posix_path'=5: expected a string"):
        load_config({"posix_path": 5})
    with pytest.raises(ValueError, match="'load_timeout_s'='nan': expected a finite number"):
        load_config({"load_timeout_s": "nan"})
    with pytest.raises(ValueError, match=r"'store_options'=.*expected a mapping"):
        load_config({"store_options": [1]})
    with pytest.raises(ValueError, match=r"unknown kvfabric config key\(s\) \['posix_pth'\]"):
        load_config({"posix_pth": "/x"})


def test_store_config_floats_are_finite():
    for text in ("nan", "inf", "-inf"):
        with pytest.raises(ValueError, match=r"posix\.gc_interval=.*expected a finite number"):
            PosixConfig.from_mapping({"posix.dirs": "/x", "posix.gc_interval": text})


def test_a_new_field_is_covered_by_its_annotation_alone():
    @dataclasses.dataclass(frozen=True)
    class Conf:
        size: Size = 0
        flag: bool = False
        ratio: float | None = None
        names: tuple[str, ...] = ()

        def __post_init__(self) -> None:
            coerce_fields(self, lambda key: f"conf {key}")

    c = Conf(size="2KiB", flag="yes", ratio="0.5", names="a, b")
    assert (c.size, c.flag, c.ratio, c.names) == (2048, True, 0.5, ("a", "b"))
    assert Conf(ratio=None).ratio is None
    with pytest.raises(ValueError, match="conf ratio='half': expected a number or null"):
        Conf(ratio="half")
    with pytest.raises(ValueError, match=r"conf names=\[1\]: expected a list of str"):
        Conf(names=[1])
