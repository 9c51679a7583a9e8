"""Block ids: the documented algorithm byte for byte, chaining, tags, errors as misses."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys

import numpy as np
import pytest
from kvf_testing import REPO

from kvfabric.ucm_layer import hashing
from kvfabric.ucm_layer.hashing import BlockHasher, Fingerprint, encode_key, tag, to_hex, untag

DOC = (REPO / "docs" / "hashing.md").read_text()
FP = Fingerprint(model="demo-model", kv_dtype="bfloat16", kv_layout="2x2x16", block_size=4, tp_size=2)


def doc_value(name: str) -> str:
    m = re.search(rf"^{re.escape(name)}\s*=\s*([0-9a-f]+)\s*$", DOC, re.M)
    assert m, f"docs/hashing.md has no line '{name} = <hex>'"
    return m.group(1)


def ref_id(fp: bytes, parent: bytes, payload: bytes, person: bytes) -> bytes:
    """The algorithm as docs/hashing.md states it, with plain hashlib."""
    h = hashlib.blake2b(parent + payload, key=fp, digest_size=16, person=person).digest()
    return h[:13] + b"\0\0\0"


def test_worked_example_fingerprint():
    assert encode_key(FP.fields()).hex() == doc_value("encode(fields)")
    want = hashlib.blake2b(
        bytes.fromhex(doc_value("encode(fields)")), digest_size=16, person=b"kvf-fprint-v1"
    )
    assert FP.digest().hex() == doc_value("fp") == want.hexdigest()


def test_worked_example_token_ids():
    fp = bytes.fromhex(doc_value("fp"))
    ids = BlockHasher(FP).hash_tokens(list(range(1, 11)))
    assert ids.shape == (2, 16) and ids.dtype == np.uint8
    assert to_hex(ids) == [doc_value("id[0]"), doc_value("id[1]")]
    parent = bytes(16)
    for i, want in enumerate(to_hex(ids)):
        tokens = np.arange(1 + 4 * i, 5 + 4 * i, dtype="<u4").tobytes()
        parent = ref_id(fp, parent, tokens, b"kvf-tokens-v1")
        assert parent.hex() == want


def test_worked_example_extra_keys_engine_hashes_and_tag():
    fp = bytes.fromhex(doc_value("fp"))
    h = BlockHasher(FP)
    extra = h.hash_tokens(np.arange(1, 9), extra_keys=[("lora-a",), None])
    assert to_hex(extra) == [doc_value("extra id[0]"), doc_value("extra id[1]")]
    assert encode_key(("lora-a",)).hex() == "4c0000000153000000066c6f72612d61"
    p0 = ref_id(
        fp, bytes(16), np.arange(1, 5, dtype="<u4").tobytes() + encode_key(("lora-a",)), b"kvf-tokens-v1"
    )
    assert p0.hex() == doc_value("extra id[0]")
    eng = h.hash_engine([bytes(range(32)), 7])
    assert to_hex(eng) == [doc_value("engine id[0]"), doc_value("engine id[1]")]
    e0 = ref_id(fp, bytes(16), encode_key(bytes(range(32))), b"kvf-engine-v1")
    assert e0.hex() == doc_value("engine id[0]")
    assert ref_id(fp, e0, encode_key(7), b"kvf-engine-v1").hex() == doc_value("engine id[1]")
    ids = h.hash_tokens(list(range(1, 11)))
    assert to_hex(tag(ids[1:2], rank=3, group=1)) == [doc_value("tagged id[1]")]


def test_chain_prefix_resume_and_input_forms():
    h = BlockHasher(Fingerprint("m", "fp16", "L", block_size=16))
    toks = list(range(1000, 1000 + 16 * 20 + 5))
    ids = h.hash_tokens(toks)
    assert ids.shape == (20, 16)
    # a prefix gets the prefix of the ids; resuming from a parent continues the chain
    assert np.array_equal(h.hash_tokens(toks[: 16 * 7]), ids[:7])
    assert np.array_equal(h.hash_tokens(toks[16 * 7 :], parent=ids[6]), ids[7:])
    assert np.array_equal(h.hash_tokens(toks[16 * 7 :], parent=tag(ids[6:7], rank=5)), ids[7:])
    for form in (np.array(toks, np.int64), np.array(toks, np.uint32), tuple(toks)):
        assert np.array_equal(h.hash_tokens(form), ids)
    # one changed token changes its block and every later id, not the earlier ones
    bad = list(toks)
    bad[16 * 9 + 3] += 1
    other = h.hash_tokens(bad)
    assert np.array_equal(other[:9], ids[:9]) and not (other[9:] == ids[9:]).all(axis=1).any()
    assert (ids[:, 13:] == 0).all()
    assert len({bytes(r) for r in ids}) == 20


@pytest.mark.parametrize(
    "field,value",
    [
        ("model", "other"),
        ("kv_dtype", "fp8"),
        ("kv_layout", "mla"),
        ("block_size", 8),
        ("tp_size", 4),
        ("salt", "x"),
    ],
)
def test_every_fingerprint_field_separates_ids(field, value):
    base = dict(model="m", kv_dtype="fp16", kv_layout="L", block_size=16, tp_size=1, salt="")
    toks = list(range(64))
    a = BlockHasher(Fingerprint(**base)).hash_tokens(toks)
    b = BlockHasher(Fingerprint(**{**base, field: value})).hash_tokens(toks)
    assert not (a[: len(b)] == b[: len(a)]).all(axis=1).any()


def test_tags_are_vectorised_and_reversible():
    ids = BlockHasher(FP).hash_tokens(list(range(40)))
    t = tag(ids, rank=65535, group=255)
    assert (hashing.rank_of(t) == 65535).all() and (hashing.group_of(t) == 255).all()
    assert np.array_equal(t[:, :13], ids[:, :13]) and np.array_equal(untag(t), ids)
    assert (hashing.rank_of(ids) == 0).all()
    assert np.array_equal(hashing.from_hex(to_hex(t)), t)
    for bad in ({"rank": -1}, {"rank": 1 << 16}, {"group": 256}, {"rank": True}):
        with pytest.raises(ValueError):
            tag(ids, **bad)


def test_hashing_errors_are_misses_never_crashes(caplog):
    h = BlockHasher(Fingerprint("m", "fp16", "L", block_size=4))
    good = h.hash_tokens(list(range(100, 116)))
    # a bad token in block 2: blocks 0 and 1 keep their ids, the rest are misses
    for bad in (-1, 1 << 32, 3.5, "x", None):
        toks = list(range(100, 116))
        toks[9] = bad
        assert np.array_equal(h.hash_tokens(toks), good[:2])
    assert h.hash_tokens(np.array([[1, 2], [3, 4]])).shape == (0, 16)
    assert h.hash_tokens(12345).shape == (0, 16)
    assert h.hash_tokens(list(range(16)), extra_keys=[None, {1: 2}, None, None]).shape == (1, 16)
    assert h.hash_tokens(list(range(16)), extra_keys=[None]).shape == (1, 16)
    assert h.hash_tokens(list(range(16)), parent=b"short").shape == (0, 16)
    assert h.hash_engine([b"a", b"b", object(), b"c"]).shape == (2, 16)
    assert h.hash_engine(None).shape == (0, 16)
    assert any("treated as a miss" in r.message for r in caplog.records)


def test_configuration_errors_raise():
    with pytest.raises(ValueError, match="block_size"):
        Fingerprint("m", "fp16", "L", block_size=0)
    with pytest.raises(TypeError, match="model"):
        Fingerprint(3, "fp16", "L", block_size=16)
    with pytest.raises(TypeError, match="Fingerprint"):
        BlockHasher("not a fingerprint")


def test_engine_hashes_of_vllm_shape():
    """vLLM's ``request.block_hashes`` are 32-byte sha256 digests (ints in old releases)."""
    hashes = [hashlib.sha256(bytes([i])).digest() for i in range(4)]
    h = BlockHasher(Fingerprint("m", "bf16", "L", block_size=16))
    ids = h.hash_engine(hashes)
    assert ids.shape == (4, 16)
    assert np.array_equal(h.hash_engine(hashes[2:], parent=ids[1]), ids[2:])
    as_ints = [int.from_bytes(x, "big") for x in hashes]
    assert not (h.hash_engine(as_ints) == ids).all(axis=1).any()


def test_deterministic_across_processes_whatever_pythonhashseed():
    code = (
        "from kvfabric.ucm_layer.hashing import *\n"
        "h = BlockHasher(Fingerprint('m', 'bf16', 'L', 16, 2, 's'))\n"
        "print(''.join(to_hex(h.hash_tokens(list(range(100)), extra_keys=[('a', 1.5, None)] * 6))),"
        " ''.join(to_hex(h.hash_engine([b'x', 3]))))\n"
    )
    outs = set()
    for seed in ("0", "1", "12345", "random"):
        env = {**__import__("os").environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        outs.add(out.stdout)
    assert len(outs) == 1
