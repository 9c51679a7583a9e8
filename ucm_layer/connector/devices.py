"""Which device a connector worker binds, and how its dumps order after the forward.

* :func:`local_device_index`: the accelerator this worker process uses, chosen the way
  vLLM's worker chooses it, so every rank binds its own device instead of device 0.
* :func:`worker_platform`: a platform instance bound to that device (not the process-wide
  default, which is always device 0).
* :func:`compute_done_event`: an event on the framework's current stream, for
  ``Delegator.dump(after=...)``: the copy stream waits on the device, the host never
  blocks.

Device indices are *visible* ordinals, as torch uses them: index ``i`` is the ``i``-th
device listed in ``CUDA_VISIBLE_DEVICES`` / ``ASCEND_RT_VISIBLE_DEVICES`` when set. No
vendor SDK (torch.cuda, torch_npu, cupy, acl) or vLLM is imported at module import.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from kvfabric.platform import registry as platform_registry
from kvfabric.platform.base import Platform
from kvfabric.platform.stream import Event

log = logging.getLogger("kvfabric.connector")

#: The variables that restrict which devices a process sees (torch ordinals index them).
VISIBLE_DEVICE_VARS: tuple[str, ...] = ("CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES")


def _vllm_device_index() -> int | None:
    """The device of vLLM's world group in this process, or None outside an initialised
    vLLM worker. vLLM (0.32, ``GroupCoordinator.__init__``) sets the group's ``device`` to
    ``cuda:<logical_device_id_to_visible_device_id(local_rank)>`` (``local_rank`` already
    adjusted for data parallelism by ``Worker.init_device``), the same index the worker
    passes to ``torch.accelerator.set_device_index``; out-of-tree platforms (Ascend) use
    ``<device_name>:<local_rank>``."""
    if "vllm" not in sys.modules:  # not running inside vLLM: nothing to ask
        return None
    try:
        from vllm.distributed import parallel_state
    except ImportError:
        return None
    if getattr(parallel_state, "_WORLD", None) is None:
        return None
    group = parallel_state.get_world_group()
    device = getattr(group, "device", None)
    if getattr(device, "type", "cpu") != "cpu" and getattr(device, "index", None) is not None:
        return int(device.index)
    local_rank = int(group.local_rank)
    try:
        from vllm.platforms import current_platform

        return int(current_platform.logical_device_id_to_visible_device_id(local_rank))
    except (ImportError, AttributeError):
        return local_rank


def _visible_count() -> int | None:
    """How many devices the visibility variables leave this process, or None if unset."""
    for var in VISIBLE_DEVICE_VARS:
        value = os.environ.get(var, "").strip()
        if value:
            return len([d for d in value.split(",") if d.strip()])
    return None


def _env_local_rank() -> int | None:
    """``LOCAL_RANK`` (torchrun and most launchers) as a visible ordinal, or None."""
    raw = os.environ.get("LOCAL_RANK", "").strip()
    if not raw:
        return None
    try:
        rank = int(raw)
    except ValueError as e:
        raise ValueError(f"LOCAL_RANK must be an integer, got {raw!r}") from e
    if rank < 0:
        raise ValueError(f"LOCAL_RANK must be >= 0, got {rank}")
    visible = _visible_count()
    if visible is not None and rank >= visible:
        if visible == 1:  # the launcher pinned this process to one device: that one
            return 0
        raise ValueError(
            f"LOCAL_RANK={rank} but only {visible} devices are visible "
            f"({', '.join(f'{v}={os.environ.get(v)!r}' for v in VISIBLE_DEVICE_VARS if os.environ.get(v))})"
        )
    return rank


def _framework_device_index() -> int | None:
    """torch's current CUDA / NPU device when torch has initialised one, else None.
    Only consults torch if it is already imported (it cannot have a device otherwise)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    for dev in (getattr(torch, "npu", None), torch.cuda):
        if dev is None:
            continue
        is_initialized = getattr(dev, "is_initialized", None)
        if is_initialized is not None and is_initialized():
            return int(dev.current_device())
    return None


def local_device_index() -> int:
    """The device index (a visible ordinal) this worker process must use.

    In order: vLLM's world group device (its local rank mapped to a visible device, as
    vLLM's worker binds it), then ``LOCAL_RANK`` (a process pinned to a single visible
    device gets 0), then torch's current CUDA / NPU device if torch has initialised one,
    else 0. ``ValueError`` for a malformed ``LOCAL_RANK`` or one beyond the visible devices.
    """
    for source, find in (
        ("vllm world group", _vllm_device_index),
        ("LOCAL_RANK", _env_local_rank),
        ("framework current device", _framework_device_index),
    ):
        index = find()
        if index is not None:
            log.debug("kvfabric worker device %d (from %s)", index, source)
            return index
    return 0


def worker_platform(name: str | None, device_index: int) -> Platform:
    """A new platform instance of ``name`` (resolved as ``registry.create`` does: the
    name, ``KVFABRIC_PLATFORM``, detection, sim) bound to ``device_index``: every
    allocation, stream, event and IPC mapping of it is on that device. It is not the
    process-wide ``registry.default()`` (which is not created or changed); the caller owns
    it and closes it. ``ValueError`` for a negative index or a device that does not exist.
    """
    if isinstance(device_index, bool) or not isinstance(device_index, int) or device_index < 0:
        raise ValueError(f"device_index must be an index >= 0, got {device_index!r}")
    platform = platform_registry.create(name, device=device_index)
    log.info("kvfabric worker platform: %r", platform)
    return platform


def compute_done_event(platform: Platform, tensor: Any = None) -> Event | None:
    """An event after the work the framework has queued so far on its current stream
    (the stream vLLM's forward ran on) on ``platform``'s device, for
    ``Delegator.dump(after=...)``: the dump's copy stream waits on it on the device; the
    host does not block.

    None when there is nothing to wait for: the platform has no external streams (sim:
    the forward is synchronous), ``tensor`` (e.g. a KV cache layer) is given and lives in
    host memory, or the framework has not initialised the device. Must be called on the
    thread that ran the forward (torch's current stream is per thread)."""
    if not platform.supports_external_streams:
        return None
    if tensor is not None and getattr(getattr(tensor, "device", None), "type", "cpu") == "cpu":
        return None
    handle = platform.framework_stream()
    if handle is None:
        return None
    return platform.record_external(handle)


__all__ = ["VISIBLE_DEVICE_VARS", "compute_done_event", "local_device_index", "worker_platform"]
