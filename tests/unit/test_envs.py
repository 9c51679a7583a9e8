import pytest

from kvfabric import envs


@pytest.mark.parametrize(
    "text,value",
    [
        ("4GiB", 4 << 30),
        ("512MB", 512_000_000),
        ("65536", 65536),
        ("1.5KiB", 1536),
        ("2 mib", 2 << 20),
        (1024, 1024),
        ("0", 0),
    ],
)
def test_parse_size(text, value):
    assert envs.parse_size(text) == value


@pytest.mark.parametrize("text", ["", "GiB", "4 parsecs", "-1", "1e"])
def test_parse_size_rejects_nonsense(text):
    with pytest.raises(ValueError):
        envs.parse_size(text)


def test_parse_size_rejects_wrong_types():
    with pytest.raises(TypeError):
        envs.parse_size(True)
    with pytest.raises(TypeError):
        envs.parse_size(1.5)


def test_env_var_names_itself_on_a_bad_value(monkeypatch):
    monkeypatch.setenv("KVFABRIC_NATIVE", "perhaps")
    with pytest.raises(ValueError, match="KVFABRIC_NATIVE"):
        envs.KVFABRIC_NATIVE.get()
    monkeypatch.setenv("KVFABRIC_NATIVE", "off")
    assert envs.KVFABRIC_NATIVE.get() is False


def test_defaults_apply_when_unset(monkeypatch):
    monkeypatch.delenv("KVFABRIC_PLATFORM", raising=False)
    assert envs.KVFABRIC_PLATFORM.get() is None
    monkeypatch.setenv("KVFABRIC_PLATFORM", " SIM ")
    assert envs.KVFABRIC_PLATFORM.get() == "sim"
