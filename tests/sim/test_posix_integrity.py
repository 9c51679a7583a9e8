"""The posix store's checksums: same-size flips in block files for every shard layout and
read path, damaged trailers, files from before trailers, and the start-up write probe."""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from store_faults import FLIP_AT, plant_flip
from stores import Blocks, block_bytes, random_ids

from kvfabric.platform.checksum import Verify
from kvfabric.platform.sim import SimPlatform
from kvfabric.platform.types import Medium
from kvfabric.ucm_layer.store.base import BlockStatus, StoreLayout
from kvfabric.ucm_layer.store.posix import PosixConfig, PosixStore
from kvfabric.ucm_layer.store.posix_files import MAGIC, DirectoryUnusable

OK, MISSING, CORRUPT = int(BlockStatus.OK), int(BlockStatus.MISSING), int(BlockStatus.CORRUPT)
N = 4

LAYOUTS = {
    "one-shard": (StoreLayout((4096, 1000, 77)), False),
    "one-shard-o-direct": (StoreLayout((4096, 8192)), True),  # aligned: trailer padded to 4096
    "one-shard-large": (StoreLayout((300_000, 400_000)), False),  # larger than a core's L2
    "two-shards": (StoreLayout((3000, 1000), num_shards=2), False),
    "two-shards-aligned": (StoreLayout((4096,), num_shards=2), False),
}
DESTS = {
    "device": (Medium.HBM, False),  # bounce area, then one batched copy
    "host-contiguous": (Medium.DRAM, True),  # read straight into the caller's memory
    "host-pieces": (Medium.DRAM, False),  # scatter read into the pieces
}


@pytest.fixture
def plat():
    p = SimPlatform()
    yield p
    p.close()


def posix(root: Path, plat, layout: StoreLayout, **cfg) -> PosixStore:
    conf = {"dirs": (str(root / "d0"),), "io_threads": 2, **cfg}
    return PosixStore(PosixConfig(**conf), platform=plat, layout=layout)


def dump_shards(s: PosixStore, plat, ids: np.ndarray, layout: StoreLayout) -> None:
    for shard in range(layout.num_shards):
        b = Blocks(plat, layout, len(ids))
        b.write(block_bytes(ids, layout.shard_bytes, shard))
        assert (s.wait(s.dump(ids, shard, b.addrs)) == OK).all()
        b.free()
    assert s.lookup(ids).all()


@pytest.mark.parametrize("dest", list(DESTS))
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_flipped_bytes_in_block_files_are_never_served(tmp_path, plat, name, dest):
    layout, direct = LAYOUTS[name]
    medium, contiguous = DESTS[dest]
    s = posix(tmp_path, plat, layout, direct=direct)
    assert s.direct == direct
    try:
        ids = random_ids(N, 30)
        dump_shards(s, plat, ids, layout)
        last = layout.num_shards - 1
        path = Path(s.files.paths(ids[1:2])[0])
        size = path.stat().st_size
        plant_flip(s, ids[1], shard=last)
        plant_flip(s, ids[2], shard=last, at=layout.shard_bytes - 1)  # the last byte of the shard
        assert path.stat().st_size == size  # same size: only a checksum can tell
        if layout.num_shards > 1:  # digests are per shard: the other shard still loads
            other = Blocks(plat, layout, N, medium, contiguous)
            assert (s.wait(s.load(ids, 0, other.addrs)) == OK).all()
            assert np.array_equal(other.read(), block_bytes(ids, layout.shard_bytes, 0))
        dst = Blocks(plat, layout, N, medium, contiguous)
        st = s.wait(s.load(ids, last, dst.addrs))
        assert st.tolist() == [OK, CORRUPT, CORRUPT, OK]
        want = block_bytes(ids, layout.shard_bytes, last)
        got = dst.read()
        assert np.array_equal(got[[0, 3]], want[[0, 3]])
        assert not path.exists() and not s.lookup(ids[1:3]).any()  # dropped: rewritten by the next dump
        assert s.stats()["corrupt_blocks"] == 2 and s.stats()["load_corrupt"] == 2
        assert s.wait(s.load(ids[1:3], last, dst.addrs[:2])).tolist() == [MISSING, MISSING]
        dump_shards(s, plat, ids[1:3], layout)
        again = Blocks(plat, layout, 2, medium, contiguous)
        assert (s.wait(s.load(ids[1:3], last, again.addrs)) == OK).all()
        assert np.array_equal(again.read(), want[1:3])
        # negative control: with verification off the flip is served
        plant_flip(s, ids[1], shard=last)
        s.set_verify(Verify.OFF)
        assert (s.wait(s.load(ids[1:3], last, again.addrs)) == OK).all()
        assert np.flatnonzero(again.read()[0] != want[1]).tolist() == [FLIP_AT]
    finally:
        s.close()


def test_damaged_trailers_and_files_without_one_are_corrupt(tmp_path, plat, caplog):
    layout = StoreLayout((4096, 1000, 77))
    s = posix(tmp_path, plat, layout)
    ids = random_ids(3, 31)
    dump_shards(s, plat, ids, layout)
    paths = [Path(p) for p in s.files.paths(ids)]
    raw = paths[0].read_bytes()
    assert raw[layout.shard_bytes :][: len(MAGIC)] == MAGIC and len(raw) == s.file_bytes
    digest_at = layout.shard_bytes + len(MAGIC)
    paths[0].write_bytes(raw[:digest_at] + bytes([raw[digest_at] ^ 1]) + raw[digest_at + 1 :])
    paths[1].write_bytes(bytes(layout.shard_bytes) + bytes(s.trailer_bytes))  # zeros: no trailer magic
    paths[2].write_bytes(paths[2].read_bytes()[: layout.shard_bytes])  # the format before trailers
    dst = Blocks(plat, layout, 3)
    with caplog.at_level(logging.WARNING, "kvfabric.store"):
        st = s.wait(s.load(ids, 0, dst.addrs))
    assert (st == CORRUPT).all() and dst.untouched(2)  # a file of the wrong size is not even read
    assert not any(p.exists() for p in paths) and s.stats()["corrupt_blocks"] == 3
    assert caplog.text.count("failed checksum verification") == 1  # logged once, then counted
    dump_shards(s, plat, ids, layout)
    assert (s.wait(s.load(ids, 0, dst.addrs)) == OK).all()
    assert np.array_equal(dst.read(), block_bytes(ids, layout.shard_bytes))
    s.close()


# ---------------------------------------------------------------------------- start-up
LAYOUT = StoreLayout((4096,))


def test_a_file_where_a_directory_belongs_fails_start_up(tmp_path, plat):
    (tmp_path / "d0").write_text("not a directory")
    with pytest.raises(DirectoryUnusable, match=r"cannot make directory '.*/d0/'.*File exists"):
        posix(tmp_path, plat, LAYOUT)


def _mount_tmpfs(where: Path, options: str) -> None:
    where.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    out = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True, text=True
    )
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip()}")


def _umount(where: Path) -> None:
    subprocess.run(["umount", str(where)], capture_output=True, check=False)


def test_a_read_only_directory_fails_start_up(tmp_path, plat):
    ro = tmp_path / "d0"
    _mount_tmpfs(ro, "size=64k,ro")
    try:
        with pytest.raises(DirectoryUnusable, match=r"cannot be written .*Read-only file system"):
            posix(tmp_path, plat, LAYOUT)
    finally:
        _umount(ro)


def test_a_full_directory_fails_start_up(tmp_path, plat):
    full = tmp_path / "d0"
    _mount_tmpfs(full, "size=64k")
    try:
        fd = os.open(full / "filler", os.O_WRONLY | os.O_CREAT)
        try:  # take every page of the tmpfs
            while os.write(fd, bytes(4096)) == 4096:
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
        with pytest.raises(DirectoryUnusable, match=r"cannot be written .*No space left"):
            posix(tmp_path, plat, LAYOUT)
        assert sorted(p.name for p in full.iterdir()) == ["filler"]  # the probe left nothing
    finally:
        _umount(full)
