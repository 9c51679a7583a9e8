"""The posix store beyond the contract: file layout, atomic rename, GC, ENOSPC, O_DIRECT."""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from store_faults import FullDiskIO, StallingIO, child_dump_forever
from stores import LAYOUT, Blocks, block_bytes, dump_blocks, random_ids

from kvfabric.platform.sim import SimPlatform
from kvfabric.ucm_layer.hashing import to_hex
from kvfabric.ucm_layer.store.base import BlockStatus, StoreLayout
from kvfabric.ucm_layer.store.posix import PosixConfig, PosixStore
from kvfabric.ucm_layer.store.posix_files import FileIO, trailer_bytes

OK, MISSING, FAILED, TIMEOUT, CORRUPT = (
    int(s)
    for s in (
        BlockStatus.OK,
        BlockStatus.MISSING,
        BlockStatus.FAILED,
        BlockStatus.TIMEOUT,
        BlockStatus.CORRUPT,
    )
)
FILE_BYTES = LAYOUT.shard_bytes + trailer_bytes(1, LAYOUT.shard_bytes)  # data, then the checksum trailer


@pytest.fixture
def plat():
    p = SimPlatform()
    yield p
    p.close()


def posix(tmp_path, plat, layout=LAYOUT, **cfg):
    conf = {"dirs": (str(tmp_path / "d0"),), "io_threads": 2, **cfg}
    return PosixStore(PosixConfig(**conf), platform=plat, layout=layout)


def files_under(root: Path, suffix: str = "") -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name.endswith(suffix))


def test_one_file_per_block_named_by_hex_id_under_prefix_dirs(tmp_path, plat):
    dirs = (str(tmp_path / "a"), str(tmp_path / "b"))
    s = posix(tmp_path, plat, dirs=dirs)
    ids = random_ids(64, 1)
    assert (dump_blocks(s, plat, ids) == OK).all()
    names = to_hex(ids)
    for i, name in enumerate(names):
        k = ((int(ids[i, 0]) << 8) | int(ids[i, 1])) % 2
        path = Path(dirs[k]) / name[:3] / name
        assert path.is_file() and path.stat().st_size == FILE_BYTES
    used = {p.parent.parent.name for p in files_under(tmp_path)}
    assert used == {"a", "b"}  # spread over both backend directories
    assert not files_under(tmp_path, ".tmp")
    s.close()


def test_block_is_invisible_until_renamed(tmp_path, plat):
    s = posix(tmp_path, plat, io_threads=1)
    stall = StallingIO(str(tmp_path / "stalled"))
    s.io = stall
    ids = random_ids(1, 2)
    b = Blocks(plat, LAYOUT, 1)
    b.write(block_bytes(ids, LAYOUT.shard_bytes))
    t = s.dump(ids, 0, b.addrs)
    while not (tmp_path / "stalled").exists():
        time.sleep(0.005)
    assert not s.lookup(ids).any() and not s.check(t)
    tmps = files_under(tmp_path / "d0", ".tmp")
    assert len(tmps) == 1 and tmps[0].name.startswith(to_hex(ids)[0])
    stall.release.set()
    assert (s.wait(t) == OK).all() and s.lookup(ids).all()
    assert not files_under(tmp_path / "d0", ".tmp")
    s.close()


def test_temp_files_of_a_killed_writer_are_swept(tmp_path, plat):
    ctx = mp.get_context("spawn")
    env = {k: v for k, v in os.environ.items() if k.startswith("KVFABRIC_")}
    proc = ctx.Process(target=child_dump_forever, args=("posix", str(tmp_path), env, 7, 8, True), daemon=True)
    proc.start()
    deadline = time.monotonic() + 60
    while not (tmp_path / "stalled").exists():
        assert proc.is_alive() and time.monotonic() < deadline
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(30)
    assert files_under(tmp_path, ".tmp")
    dirs = (str(tmp_path / "a"), str(tmp_path / "b"))  # as stores.config_for lays them out
    s = PosixStore(PosixConfig(dirs=dirs), platform=plat, layout=LAYOUT, background_gc=False)
    report = s.collect()
    assert report.removed_temps >= 1 and not files_under(tmp_path, ".tmp")
    s.close()


def test_gc_removes_the_coldest_blocks_down_to_the_low_watermark(tmp_path, plat):
    per = FILE_BYTES
    s = PosixStore(
        PosixConfig(dirs=(str(tmp_path / "d0"),), capacity=10 * per, gc_high=0.9, gc_low=0.5),
        platform=plat,
        layout=LAYOUT,
        background_gc=False,
    )
    ids = random_ids(12, 3)
    assert (dump_blocks(s, plat, ids) == OK).all()
    now = time.time()
    for i, name in enumerate(to_hex(ids)):  # block i last used i hours ago... reversed: 0 is coldest
        os.utime(tmp_path / "d0" / name[:3] / name, (now - 3600 * (12 - i), now - 3600 * (12 - i)))
    hot = ids[[0, 1]]
    dst = Blocks(plat, LAYOUT, 2)
    assert (s.wait(s.load(hot, 0, dst.addrs)) == OK).all()  # loads refresh the hotness clock
    report = s.collect()
    assert report.usage_bytes <= 5 * per and report.removed_blocks == 7
    mask = s.lookup(ids)
    assert mask[[0, 1]].all() and not mask[2:9].any() and mask[9:].all()
    assert s.stats()["usage_bytes"] == report.usage_bytes
    s.close()


def test_background_gc_keeps_usage_under_capacity(tmp_path, plat):
    per = FILE_BYTES
    s = posix(tmp_path, plat, capacity=8 * per, gc_interval=0.05, gc_high=0.9, gc_low=0.5)
    for k in range(3):
        assert (dump_blocks(s, plat, random_ids(6, 10 + k)) == OK).all()
    deadline = time.monotonic() + 30
    while s.gc.usage > 8 * per or len(files_under(tmp_path / "d0")) > 8:
        assert time.monotonic() < deadline, "GC never brought usage under capacity"
        time.sleep(0.02)
    s.close()


def test_enospc_is_a_per_block_failure(tmp_path, plat):
    s = posix(tmp_path, plat, io_threads=1)
    s.io = FullDiskIO(budget=3 * FILE_BYTES)
    ids = random_ids(6, 4)
    st = dump_blocks(s, plat, ids)
    assert (st[:3] == OK).all() and (st[3:] == FAILED).all()
    assert np.array_equal(s.lookup(ids), st == OK)
    assert not files_under(tmp_path / "d0", ".tmp")
    s.io = FileIO()  # space freed: the same blocks go in now
    assert (dump_blocks(s, plat, ids) == OK).all()
    assert s.stats()["dump_failed"] == 3
    s.close()


_TINY_FS_CHILD = textwrap.dedent(
    """
    import sys, json
    sys.path.insert(0, sys.argv[2])
    import numpy as np
    from stores import Blocks, LAYOUT, block_bytes, random_ids
    from kvfabric.platform.sim import SimPlatform
    from kvfabric.status import ItemStatus
    from kvfabric.ucm_layer.store.posix import PosixConfig, PosixStore
    plat = SimPlatform()
    s = PosixStore(PosixConfig(dirs=(sys.argv[1],), io_threads=2), platform=plat, layout=LAYOUT)
    ids = random_ids(80, 5)
    b = Blocks(plat, LAYOUT, 80)
    data = block_bytes(ids, LAYOUT.shard_bytes)
    b.write(data)
    st = s.wait(s.dump(ids, 0, b.addrs))
    vis = s.lookup(ids)
    d = Blocks(plat, LAYOUT, 80)
    ld = s.wait(s.load(ids, 0, d.addrs))
    exact = bool(all(np.array_equal(d.read()[i], data[i]) for i in np.flatnonzero(ld == ItemStatus.OK)))
    print(json.dumps({"status": st.tolist(), "visible": vis.tolist(), "load": ld.tolist(), "exact": exact}))
    s.close()
    plat.close()
    """
)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root to mount a tmpfs")
def test_real_enospc_on_a_tiny_tmpfs(tmp_path):
    import json

    mnt = tmp_path / "tiny"
    mnt.mkdir()
    script = tmp_path / "child.py"
    script.write_text(_TINY_FS_CHILD)
    support = str(Path(__file__).resolve().parents[1] / "support")
    cmd = f"mount -t tmpfs -o size=256k tmpfs {mnt} && exec {sys.executable} {script} {mnt} {support}"
    out = subprocess.run(["unshare", "-m", "sh", "-c", cmd], capture_output=True, text=True, timeout=120)
    if out.returncode != 0 and "mount" in out.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip()}")
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    st = np.array(res["status"])
    assert (st == OK).any() and (st == FAILED).any()  # 80 x 5 KiB do not fit in 256 KiB
    assert set(np.unique(st)) <= {OK, FAILED}
    assert res["visible"] == (st == OK).tolist()
    assert res["exact"] and (np.array(res["load"]) == OK).tolist() == res["visible"]


def test_o_direct_where_the_file_system_takes_it(tmp_path, plat):
    layout = StoreLayout((4096, 8192), num_shards=1)
    s = posix(tmp_path, plat, layout=layout, direct=True)
    probe = os.open(str(tmp_path / "probe"), os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o600)
    os.close(probe)
    assert s.direct
    ids = random_ids(8, 6)
    data = block_bytes(ids, layout.shard_bytes)
    src, dst = Blocks(plat, layout, 8), Blocks(plat, layout, 8)
    src.write(data)
    assert (s.wait(s.dump(ids, 0, src.addrs)) == OK).all()
    assert (s.wait(s.load(ids, 0, dst.addrs)) == OK).all()
    assert np.array_equal(dst.read(), data)
    s.close()
    unaligned = posix(tmp_path, plat, direct=True)  # 5173-byte shards: buffered I/O
    assert not unaligned.direct
    unaligned.close()


def test_o_direct_falls_back_where_the_file_system_refuses_it(tmp_path, plat, monkeypatch, caplog):
    import kvfabric.ucm_layer.store.posix as posix_mod

    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(posix_mod.os, "open", no_direct)
    layout = StoreLayout((4096,))
    s = PosixStore(PosixConfig(dirs=(str(tmp_path / "d0"),), direct=True), platform=plat, layout=layout)
    monkeypatch.undo()
    assert not s.direct and "does not accept O_DIRECT" in caplog.text
    assert (dump_blocks(s, plat, random_ids(4, 7), layout) == OK).all()
    s.close()


def test_read_errors_and_foreign_files_are_failures(tmp_path, plat):
    s = posix(tmp_path, plat)
    ids = random_ids(4, 8)
    assert (dump_blocks(s, plat, ids) == OK).all()
    name = to_hex(ids[1:2])[0]
    path = tmp_path / "d0" / name[:3] / name
    path.write_bytes(path.read_bytes()[:100])  # truncated, or written by another layout
    dst = Blocks(plat, LAYOUT, 4)
    st = s.wait(s.load(ids, 0, dst.addrs))
    assert st.tolist() == [OK, CORRUPT, OK, OK] and dst.untouched(1)
    assert not path.exists() and s.stats()["corrupt_blocks"] == 1  # dropped: the next dump rewrites it
    assert (dump_blocks(s, plat, ids) == OK).all() and path.stat().st_size == FILE_BYTES

    class EIO(FileIO):
        def read_into(self, fd, view, offset):
            raise OSError(errno.EIO, "I/O error")

        def read_scatter(self, fd, views, offset):
            raise OSError(errno.EIO, "I/O error")

    s.io = EIO()
    assert (s.wait(s.load(ids, 0, dst.addrs)) == FAILED).all()
    s.close()


def _dump_shard_child(root: str, env: dict, shard: int) -> None:
    os.environ.update(env)
    plat = SimPlatform()
    layout = StoreLayout((3000, 1000), num_shards=2)
    s = PosixStore(PosixConfig(dirs=(root,)), platform=plat, layout=layout)
    ids = random_ids(32, 11)
    b = Blocks(plat, layout, 32)
    b.write(block_bytes(ids, layout.shard_bytes, shard))
    st = s.wait(s.dump(ids, shard, b.addrs))
    s.close()
    sys.exit(0 if (st == OK).all() else 1)


def test_shards_from_two_processes_assemble_into_one_file(tmp_path, plat):
    layout = StoreLayout((3000, 1000), num_shards=2)
    root = str(tmp_path / "d0")
    ctx = mp.get_context("spawn")
    env = {k: v for k, v in os.environ.items() if k.startswith("KVFABRIC_")}
    proc = ctx.Process(target=_dump_shard_child, args=(root, env, 1))
    proc.start()
    s = PosixStore(PosixConfig(dirs=(root,)), platform=plat, layout=layout)
    ids = random_ids(32, 11)
    b = Blocks(plat, layout, 32)
    b.write(block_bytes(ids, layout.shard_bytes, 0))
    assert (s.wait(s.dump(ids, 0, b.addrs)) == OK).all()
    proc.join(120)
    assert proc.exitcode == 0
    assert s.lookup(ids).all()
    assert not files_under(Path(root), ".part")
    for shard in (0, 1):
        d = Blocks(plat, layout, 32)
        assert (s.wait(s.load(ids, shard, d.addrs)) == OK).all()
        assert np.array_equal(d.read(), block_bytes(ids, layout.shard_bytes, shard))
    assert {p.stat().st_size for p in files_under(Path(root))} == {
        2 * layout.shard_bytes + trailer_bytes(2, layout.shard_bytes)
    }
    s.close()


def test_prefetch_and_config_errors(tmp_path, plat):
    s = posix(tmp_path, plat)
    ids = random_ids(4, 12)
    dump_blocks(s, plat, ids)
    s.prefetch(ids)  # best effort; must not disturb anything
    assert s.lookup(ids).all()
    s.close()
    with pytest.raises(ValueError, match=r"posix\.dirs is required"):
        PosixConfig.from_mapping({"posix.capacity": "1GiB"})
    with pytest.raises(ValueError, match="gc_low"):
        PosixConfig.from_mapping({"posix.dirs": "/tmp/x", "posix.gc_low": 0.9, "posix.gc_high": 0.8})
    with pytest.raises(ValueError, match=r"bad value for config key posix\.capacity"):
        PosixConfig.from_mapping({"posix.dirs": "/tmp/x", "posix.capacity": "lots"})
    with pytest.raises(ValueError, match=r"unknown config key\(s\) posix.dir "):
        PosixConfig.from_mapping({"posix.dir": "/tmp/x"})
    with pytest.raises(ValueError, match="twice"):
        PosixConfig.from_mapping({"posix.dirs": ["/tmp/x", "/tmp/x/"]})
