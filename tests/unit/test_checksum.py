"""``platform.checksum``: one digest whatever the cut, 0 never a digest, clear errors."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import xxhash

from kvfabric.platform import checksum
from kvfabric.platform.checksum import Verify


def test_the_same_bytes_digest_the_same_however_they_are_cut():
    data = np.random.default_rng(1).integers(0, 256, 1 << 16, dtype=np.uint8)
    base = data.ctypes.data
    whole = checksum.digest_range(base, data.nbytes)
    assert whole == checksum.digest_bytes(data.tobytes()) == xxhash.xxh3_64_intdigest(data.tobytes())
    cuts = [0, 1, 100, 4096, 4097, 30000, data.nbytes]
    pieces = [(base + a, b - a) for a, b in itertools.pairwise(cuts)]
    assert checksum.digest_ranges(pieces) == whole
    assert checksum.digest_ranges([(base, 0), *pieces, (base, 0)]) == whole  # empty ranges ignored
    views = [memoryview(data)[a:b] for a, b in itertools.pairwise(cuts)]
    assert checksum.digest_views(views) == whole


def test_ranges_are_taken_in_the_order_given():
    data = np.arange(256, dtype=np.uint8)
    a, b = (data.ctypes.data, 128), (data.ctypes.data + 128, 128)
    assert checksum.digest_ranges([a, b]) != checksum.digest_ranges([b, a])
    swapped = np.concatenate([data[128:], data[:128]]).tobytes()
    assert checksum.digest_ranges([b, a]) == checksum.digest_bytes(swapped)


def test_one_flipped_bit_changes_the_digest():
    data = np.zeros(1 << 20, np.uint8)
    before = checksum.digest_range(data.ctypes.data, data.nbytes)
    data[12345] ^= 0x10
    assert checksum.digest_range(data.ctypes.data, data.nbytes) != before


def test_zero_means_no_checksum_and_is_never_a_digest(monkeypatch):
    monkeypatch.setattr(checksum.xxhash, "xxh3_64_intdigest", lambda _data: 0)
    assert checksum.NONE == 0
    assert checksum.digest_bytes(b"anything") == 1


def test_verify_parse():
    assert Verify.parse("ON") is Verify.ON and Verify.parse(False) is Verify.OFF
    assert Verify.parse(Verify.OFF) is Verify.OFF
    with pytest.raises(ValueError, match="store verify='sometimes': expected one of on, off"):
        Verify.parse("sometimes", "store verify")


def test_impossible_ranges_are_refused():
    with pytest.raises(ValueError, match="impossible range"):
        checksum.digest_range(0, 16)
    with pytest.raises(ValueError, match="impossible range"):
        checksum.view(4096, -1)
