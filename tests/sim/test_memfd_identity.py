"""A memfd segment's handle names its memory, not a descriptor slot: when ``/proc/<pid>/fd/<fd>``
now holds another memfd (the owner freed the segment and the number was reused, or the pid
belongs to another process now) an attach is refused as "gone" and never maps the other
segment's bytes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvfabric.errors import HandleError
from kvfabric.platform import memfd, shm
from kvfabric.platform.hugepages import PageKind

pytestmark = pytest.mark.sim

PAGE = 2 << 20
NBYTES = 64 << 10


def _segment(tag: int) -> shm.Segment:
    seg = memfd.create(
        f"{shm.PREFIX}{os.getpid()}.{os.getpid() + tag}.{tag}.cafe{tag:04x}", NBYTES, PageKind.THP, PAGE
    )
    assert seg.array is not None
    seg.array[:] = tag
    return seg


def test_a_reused_descriptor_number_is_gone_not_the_new_segment():
    old = _segment(1)
    stale, fd = old.ref, old.fd
    old.close()
    old.unlink()  # the owner frees it: the descriptor number is free again
    new = _segment(2)
    try:
        assert new.fd == fd, "the kernel hands out the lowest free descriptor"
        with pytest.raises(HandleError, match="is gone"):
            shm.attach(stale, NBYTES)
        peer = shm.attach(new.ref, NBYTES)  # the descriptor itself opens: the refusal is the name's
        assert peer.array is not None and np.all(peer.array == 2)
        peer.close()
        assert new.array is not None and np.all(new.array == 2)
    finally:
        new.close()
        new.unlink()


_CHILD = textwrap.dedent(
    """
    import sys
    from kvfabric.platform import memfd, shm
    from kvfabric.platform.hugepages import PageKind
    import os
    seg = memfd.create(f"{shm.PREFIX}{os.getpid()}.7.0.beef0001", int(sys.argv[1]), PageKind.THP, 2 << 20)
    seg.array[:] = 9
    print(seg.ref, flush=True)
    sys.stdin.read()
    """
)


def test_a_reused_pid_holding_another_memfd_is_gone():
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(NBYTES)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        ref = child.stdout.readline().strip()
        fd = ref.rpartition("@")[2]
        # a handle an earlier process with this pid handed out for its own segment, same descriptor number
        stale = f"{shm.PREFIX}{child.pid}.8.0.dead0001@{fd}"
        with pytest.raises(HandleError, match="is gone"):
            shm.attach(stale, NBYTES)
        peer = shm.attach(ref, NBYTES)  # the live owner's own handle maps its bytes
        assert peer.array is not None and np.all(peer.array == 9)
        peer.close()
    finally:
        child.communicate(input="", timeout=30)
    assert child.returncode == 0
