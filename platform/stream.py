"""``Stream`` and ``Event``: ordering of asynchronous copies.

Contract (the CUDA / ACL model):

* Work submitted to one stream runs in submission order; streams are independent.
* ``event.record(stream)`` marks the point reached by the stream's work submitted so far;
  ``stream.wait_event(event)`` makes later work on ``stream`` wait for that point;
  ``event.query()`` / ``event.synchronize()`` test / wait for it from the host. An event
  never recorded counts as complete.
* A copy that fails on a stream makes the next ``stream.synchronize()`` raise
  ``TransferFailed``, and so does the ``synchronize`` of the next event recorded after
  it (an event reports the failures since the stream's previous event); each reporter
  reports it once.
* Memory named by work in flight must stay alive until that work completes: callers own
  the buffers, streams do not keep them alive.

Streams and events belong to the platform that made them and are closed with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvfabric.platform.base import Platform


class Stream:
    """An ordered queue of asynchronous device work."""

    __slots__ = ("__weakref__", "_closed", "handle", "platform")

    def __init__(self, platform: Platform, handle: Any) -> None:
        self.platform = platform
        self.handle = handle
        self._closed = False

    def _check(self) -> None:
        if self._closed:
            raise ValueError(f"stream {self!r} is closed")

    def synchronize(self, timeout: float | None = None) -> None:
        """Block until every piece of work submitted so far has finished.

        ``timeout`` (seconds) is honoured where the backend can wait with one; on expiry a
        ``TimeoutError`` is raised and the work stays queued.
        """
        self._check()
        self.platform._call("stream synchronize", self.platform._stream_synchronize, self, timeout)

    def query(self) -> bool:
        """True when all submitted work has finished (never blocks)."""
        self._check()
        return bool(self.platform._call("stream query", self.platform._stream_query, self))

    def wait_event(self, event: Event) -> None:
        """Make work submitted to this stream from now on wait until ``event`` completes."""
        self._check()
        if not isinstance(event, Event) or event.platform is not self.platform:
            raise TypeError("wait_event needs an Event of the same platform")
        self.platform._call("stream wait event", self.platform._stream_wait_event, self, event)

    def close(self) -> None:
        """Wait for submitted work, then release the stream. Idempotent."""
        if not self._closed:
            self._closed = True
            self.platform._close_stream(self)

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Stream({self.platform.name}, {'closed' if self._closed else 'open'})"


class Event:
    """A marker in a stream's work, for host waits and cross-stream ordering."""

    __slots__ = ("__weakref__", "handle", "platform")

    def __init__(self, platform: Platform, handle: Any) -> None:
        self.platform = platform
        self.handle = handle

    def record(self, stream: Stream) -> None:
        """Capture the work submitted to ``stream`` so far; completes when that work has."""
        if not isinstance(stream, Stream) or stream.platform is not self.platform:
            raise TypeError("Event.record needs a Stream of the same platform")
        stream._check()
        self.platform._call("event record", self.platform._event_record, self, stream)

    def query(self) -> bool:
        """True when the recorded work has finished (or the event was never recorded)."""
        return bool(self.platform._call("event query", self.platform._event_query, self))

    def synchronize(self, timeout: float | None = None) -> None:
        """Block until the recorded work has finished; raise if a copy in it failed."""
        self.platform._call("event synchronize", self.platform._event_synchronize, self, timeout)

    def __repr__(self) -> str:
        return f"Event({self.platform.name})"
