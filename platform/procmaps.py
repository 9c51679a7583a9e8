"""Whether an address range is mapped readable in this process (``/proc/self/maps``).

Copies from or into an address that is not mapped end the process with SIGSEGV; callers
that take raw addresses (``PoolClient.register_buffer``) check the range once, when the
memory is registered, so a bogus address is a ``ValueError`` and not a crash later. The
check reads the kernel's list of this process's mappings (no byte of the range is touched,
so nothing is faulted in); where that list does not exist (not Linux) the check passes.
"""

from __future__ import annotations

ADDRESS_LIMIT = 1 << 64
MAPS = "/proc/self/maps"


def unreadable_part(ptr: int, nbytes: int, maps: str = MAPS) -> tuple[int, int] | None:
    """The first ``(start, end)`` of ``[ptr, ptr + nbytes)`` that no readable mapping of
    this process covers, or None when the whole range is readable (or cannot be checked)."""
    try:
        with open(maps) as f:
            text = f.read()
    except OSError:
        return None
    cur, end = ptr, ptr + nbytes
    for line in text.splitlines():  # the kernel lists mappings in address order
        span, _, rest = line.partition(" ")
        lo_s, _, hi_s = span.partition("-")
        lo, hi = int(lo_s, 16), int(hi_s, 16)
        if hi <= cur:
            continue
        if lo > cur:
            return cur, min(lo, end)
        if not rest.startswith("r"):
            return cur, min(hi, end)
        cur = hi
        if cur >= end:
            return None
    return cur, end


def check_mapped(ptr: int, nbytes: int, what: str) -> None:
    """``ValueError`` naming ``what`` unless ``[ptr, ptr + nbytes)`` is a possible address
    range mapped readable in this process (see module docstring)."""
    if ptr <= 0 or nbytes <= 0 or ptr + nbytes > ADDRESS_LIMIT:
        raise ValueError(f"{what}: {ptr:#x}+{nbytes} is not a possible address range")
    gap = unreadable_part(ptr, nbytes)
    if gap is not None:
        raise ValueError(
            f"{what}: bytes {gap[0]:#x}..{gap[1]:#x} of {ptr:#x}+{nbytes} are not mapped readable "
            "in this process (a copy there would crash it)"
        )
