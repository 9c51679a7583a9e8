"""kvfabric's one configuration language (``kvfabric.settings``): each type, ranges and
choices from the field metadata, unknown keys listing the known ones, required keys, the
three sources (mapping, YAML file, ``key=value`` flags), prefixed sections of one flat
mapping, and ``describe`` rows; and that the pool, GVA, connector and store configs all
speak it."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any, ClassVar

import pytest

from kvfabric.envs import parse_size
from kvfabric.pool.config import PoolConfig
from kvfabric.pool.gva.config import GvaConfig
from kvfabric.settings import (
    Expected,
    Size,
    coerce_fields,
    describe,
    from_file,
    from_flags,
    from_mapping,
    load,
    parse_flags,
    section,
    setting,
)
from kvfabric.ucm_layer.connector.config import ConnectorConfig, load_config, sparse_algorithms
from kvfabric.ucm_layer.sparse.base import ALGORITHMS
from kvfabric.ucm_layer.store.cache import CacheConfig
from kvfabric.ucm_layer.store.config import StoreConfig
from kvfabric.ucm_layer.store.config import describe as store_describe
from kvfabric.ucm_layer.store.pipeline import PipelineConfig
from kvfabric.ucm_layer.store.pool import PoolStoreConfig
from kvfabric.ucm_layer.store.posix import PosixConfig


class Mode(enum.Enum):
    FAST = "fast"
    SAFE = "safe"


def _even(v: Any) -> int:
    if not isinstance(v, int) or v % 2:
        raise Expected("an even integer")
    return v


@dataclasses.dataclass(frozen=True)
class Conf:
    path: str = setting(doc="where it goes")
    size: Size = setting(0, doc="bytes")
    workers: int = setting(2, doc="threads", lo=1, hi=8)
    ratio: float = setting(0.5, doc="a fraction", gt=0, hi=1)
    flag: bool = setting(False, doc="a switch")
    mode: Mode = setting(Mode.FAST, doc="how")
    write: str = setting("through", doc="write policy", choices=("through", "behind"))
    names: tuple[str, ...] = setting(("a",), doc="names", choices=lambda: ("a", "b", "c"))
    limit: float | None = setting(None, doc="optional limit", lo=0)
    even: int = setting(0, doc="an even number", parse=_even)
    extra: Mapping[str, Any] = setting(default_factory=dict, doc="anything")

    def __post_init__(self) -> None:
        coerce_fields(self, lambda key: f"conf {key}")


def _err(match: str, **kwargs: Any) -> None:
    with pytest.raises(ValueError, match=match):
        Conf(**{"path": "/p", **kwargs})


def test_each_type_is_converted_from_text():
    c = Conf(
        path="/p", size="2KiB", workers="3", ratio="0.25", flag="on", mode="SAFE", names="a, c", limit="1.5"
    )
    assert (c.size, c.workers, c.ratio, c.flag, c.mode, c.names, c.limit) == (
        2048,
        3,
        0.25,
        True,
        Mode.SAFE,
        ("a", "c"),
        1.5,
    )
    assert Conf(path="/p", mode=Mode.SAFE, limit=None).limit is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"path": 5}, r"conf path=5: expected a string"),
        ({"size": "lots"}, r"conf size='lots': expected a size in bytes"),
        ({"workers": "many"}, r"conf workers='many': expected an integer"),
        ({"flag": "maybe"}, r"conf flag='maybe': expected a boolean"),
        ({"mode": "slow"}, r"conf mode='slow': expected one of fast, safe"),
        ({"ratio": "nan"}, r"conf ratio='nan': expected a finite number"),
        ({"extra": [1]}, r"conf extra=\[1\]: expected a mapping"),
    ],
)
def test_a_wrong_type_names_the_key_the_value_and_what_was_expected(kwargs, match):
    _err(match, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"workers": 0}, r"conf workers=0: expected an integer in \[1, 8\]"),
        ({"workers": "9"}, r"conf workers='9': expected an integer in \[1, 8\]"),
        ({"ratio": 0}, r"conf ratio=0: expected a number > 0 and <= 1"),
        ({"ratio": 1.5}, r"conf ratio=1.5: expected a number > 0 and <= 1"),
        ({"limit": -1}, r"conf limit=-1: expected a number >= 0"),
        ({"write": "later"}, r"conf write='later': expected one of through, behind"),
        ({"names": "a, z"}, r"conf names='a, z': expected a list of one of a, b, c"),
        ({"even": 3}, r"conf even=3: expected an even integer"),
    ],
)
def test_ranges_choices_and_parsers_from_the_metadata(kwargs, match):
    _err(match, **kwargs)


def test_choices_are_normalised_and_bounds_are_inclusive():
    c = Conf(path="/p", write=" Behind ", names=("B",), workers=8, ratio=1, limit=0)
    assert (c.write, c.names, c.workers, c.ratio, c.limit) == ("behind", ("b",), 8, 1.0, 0.0)


def test_unknown_keys_list_the_known_ones_sorted_and_required_keys_are_named():
    known = sorted(f.name for f in dataclasses.fields(Conf))
    with pytest.raises(ValueError) as e:
        from_mapping(Conf, {"path": "/p", "wrokers": 2, "zz": 1}, "conf")
    assert str(e.value) == f"unknown conf key(s) ['wrokers', 'zz']; known: {known}"
    with pytest.raises(ValueError, match=r"^conf key path is required \(where it goes\)$"):
        from_mapping(Conf, {"workers": 2}, "conf")
    with pytest.raises(ValueError, match="conf must be a mapping"):
        from_mapping(Conf, ["path"], "conf")  # type: ignore[arg-type]


def test_yaml_file_flags_mapping_and_overrides_in_order(tmp_path):
    f = tmp_path / "conf.yaml"
    f.write_text("path: /from-file\nworkers: 4\nflag: on\nsize: 1KiB\n")
    assert from_file(Conf, f, "conf").workers == 4
    c = load(Conf, {"workers": 5, "size": "2KiB"}, what="conf", file=f, flags=["workers=6"], size=4096)
    assert (c.path, c.workers, c.flag, c.size) == ("/from-file", 6, True, 4096)
    f.write_text("- not\n- a mapping\n")
    with pytest.raises(ValueError, match="must be a mapping of keys to values"):
        from_file(Conf, f, "conf")
    with pytest.raises(ValueError, match="cannot be read"):
        from_file(Conf, tmp_path / "absent.yaml", "conf")


def test_flags():
    assert parse_flags(["a=1", " b = x=y ", "c="]) == {"a": "1", "b": "x=y", "c": ""}
    c = from_flags(Conf, ["path=/p", "workers=7", "flag=yes", "names=b,c", "mode=safe"], "conf")
    assert (c.workers, c.flag, c.names, c.mode) == (7, True, ("b", "c"), Mode.SAFE)
    with pytest.raises(ValueError, match="conf flag 'workers' is not KEY=VALUE"):
        from_flags(Conf, ["workers"], "conf")
    with pytest.raises(ValueError, match=r"unknown conf key\(s\) \['wrkers'\]"):
        from_flags(Conf, ["path=/p", "wrkers=1"], "conf")


@dataclasses.dataclass(frozen=True)
class Sect(StoreConfig):
    PREFIX: ClassVar[str] = "sect"

    dirs: tuple[str, ...] = setting(doc="directories")
    workers: int = setting(2, doc="threads", lo=1)


def test_prefixed_sections_of_one_flat_mapping():
    flat = {"store": "x", "sect.dirs": "/a,/b", "sect.workers": "3", "other.workers": "bad"}
    assert section(flat, "sect") == {"dirs": "/a,/b", "workers": "3"}
    c = Sect.from_mapping(flat)
    assert (c.dirs, c.workers) == (("/a", "/b"), 3)
    assert Sect.from_mapping({"sect": {"dirs": ["/n"]}, "sect.workers": 4}) == Sect(("/n",), 4)
    assert Sect.from_flags(["sect.dirs=/f", "other.x=1"]).dirs == ("/f",)
    with pytest.raises(ValueError) as e:
        Sect.from_mapping({"sect.dirs": "/a", "sect.wrokers": 1})
    assert str(e.value) == "unknown config key(s) sect.wrokers for 'sect'; known: sect.dirs, sect.workers"
    with pytest.raises(ValueError, match=r"^config key sect\.dirs is required \(directories\)$"):
        Sect.from_mapping({"sect.workers": 1})
    with pytest.raises(
        ValueError, match=r"bad value for config key sect\.workers=0: expected an integer >= 1"
    ):
        Sect.from_mapping({"sect.dirs": "/a", "sect.workers": 0})


def test_describe_rows_come_from_the_metadata():
    rows = describe(Conf)
    assert rows[0] == ("path", "required", "where it goes")
    assert ("workers", "2", "threads") in rows and ("flag", "false", "a switch") in rows
    assert ("mode", "'fast'", "how") in rows and ("extra", "{}", "anything") in rows
    assert describe(Sect, "sect") == [
        ("sect.dirs", "required", "directories"),
        ("sect.workers", "2", "threads"),
    ]
    assert store_describe("sect", Sect) == describe(Sect, "sect")
    assert dict((k, d) for k, d, _ in describe(GvaConfig))["node"] == "computed"


@pytest.mark.parametrize(
    "cls", [PoolConfig, GvaConfig, ConnectorConfig, PosixConfig, CacheConfig, PipelineConfig, PoolStoreConfig]
)
def test_every_config_documents_every_key(cls):
    assert all(meaning for _, _, meaning in describe(cls)), [k for k, _, m in describe(cls) if not m]


def _doc_rows(name: str, section: str | None = None) -> dict[str, str]:
    """``key -> default`` of the ``| `key` | default | meaning |`` rows of a doc (within the
    ``## section`` heading when given); a row of several keys has their defaults in order."""
    import kvfabric

    out, inside = {}, section is None
    with open(f"{kvfabric.__path__[0]}/docs/{name}") as f:
        for line in f:
            if section is not None and line.startswith("## "):
                inside = line.startswith(f"## {section}")
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not inside or len(cells) < 3 or not cells[0].startswith("`"):
                continue
            keys = [k.strip().strip("`") for k in cells[0].split(",")]
            values = [v.strip() for v in cells[1].split(",")]
            out.update(zip(keys, values if len(values) == len(keys) else [cells[1]] * len(keys)))
    return out


def _same_default(doc: str, code: str) -> bool:
    doc, code = doc.strip("`").strip("'\""), code.strip("'\"")
    for parse in (parse_size, float):
        try:
            return parse(doc.replace(" ", "")) == parse(code)
        except (TypeError, ValueError):
            pass
    return doc == code


def test_the_store_keys_and_defaults_in_docs_match_the_configs():
    doc = {
        k: v
        for k, v in _doc_rows("stores.md").items()
        if k.startswith(("posix.", "cache.", "pipeline.", "pool."))
    }
    rows = [
        r
        for cls in (PosixConfig, CacheConfig, PipelineConfig, PoolStoreConfig)
        for r in describe(cls, cls.PREFIX)
    ]
    assert set(doc) == {k for k, _, _ in rows}
    assert [k for k, default, _ in rows if not _same_default(doc[k], default)] == []


def test_the_connector_keys_in_docs_match_the_config():
    doc = _doc_rows("vllm.md", "Configuration (`kv_connector_extra_config`)")
    assert set(doc) == {f.name for f in dataclasses.fields(ConnectorConfig)}


def test_pool_gva_and_connector_ranges_come_from_the_metadata():
    with pytest.raises(ValueError, match=r"pool config rpc_spin_us=-1: expected a number in \[0, 10000\]"):
        PoolConfig(rpc_spin_us=-1)
    with pytest.raises(ValueError, match=r"pool config write_lease_s=0: expected a number > 0"):
        PoolConfig(write_lease_s=0)
    assert PoolConfig.from_flags(["dram=2MiB", "pretouch=off"], name="f").dram == 2 << 20
    with pytest.raises(ValueError, match=r"GvaConfig\.copy_streams=0: expected an integer >= 1"):
        GvaConfig(copy_streams=0)
    with pytest.raises(ValueError, match=r"GvaConfig\.transports=\('pigeon',\): expected a list of one of"):
        GvaConfig(transports=("pigeon",))
    with pytest.raises(ValueError, match=r"'staging_blocks'=0: expected an integer >= 1"):
        load_config({"staging_blocks": 0})
    assert load_config({"cache_bytes": "2GiB", "delegator": "auto"}).cache_bytes == 2 << 30


def test_connector_sparse_names_are_the_sparse_registry():
    assert sparse_algorithms() == tuple(ALGORITHMS.names())
    for name in ALGORITHMS.names():
        assert load_config({"sparse": name.upper()}).sparse == name
    ALGORITHMS.register("zz_test_algo", "kvfabric.ucm_layer.sparse.dense:DenseAttention")
    try:
        assert load_config({"sparse": "zz_test_algo"}).sparse == "zz_test_algo"
    finally:
        ALGORITHMS.unregister("zz_test_algo")
    with pytest.raises(ValueError, match="'sparse'='zz_test_algo': expected true/false or one of dense"):
        load_config({"sparse": "zz_test_algo"})
