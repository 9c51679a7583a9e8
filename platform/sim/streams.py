"""Sim streams and events: one worker thread per stream runs its jobs in order.

A job is a callable. A job that raises stores the error as the stream's pending error,
reported by the next ``synchronize`` and by the next event recorded after it (an event
reports the failures since the stream's previous event, so a later event on a healthy
stream completes cleanly); the stream keeps going, as a device stream would with later,
independent work.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

Job = Callable[[], None]


class SimEventState:
    """``target``: how many records were issued; ``done``: how many completed."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.target = 0
        self.done = 0
        self.error: BaseException | None = None

    def issue(self) -> int:
        with self.cond:
            self.target += 1
            return self.target

    def complete(self, ticket: int, error: BaseException | None) -> None:
        with self.cond:
            if ticket > self.done:
                self.done = ticket
                self.error = error
            self.cond.notify_all()

    def query(self) -> bool:
        with self.cond:
            return self.done >= self.target

    def wait(self, ticket: int | None = None, timeout: float | None = None) -> BaseException | None:
        with self.cond:
            t = self.target if ticket is None else ticket
            if not self.cond.wait_for(lambda: self.done >= t, timeout):
                raise TimeoutError(f"sim event not reached within {timeout} s")
            return self.error


class SimStreamWorker:
    """An ordered job queue drained by one daemon thread."""

    def __init__(self, name: str) -> None:
        self._cond = threading.Condition()
        self._jobs: deque[Job | None] = deque()
        self._submitted = 0
        self._completed = 0
        self._pending_error: BaseException | None = None
        self._recent_error: BaseException | None = None  # since the last event record
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cond:
            self._jobs.append(job)
            self._submitted += 1
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._jobs))
                job = self._jobs.popleft()
            if job is None:
                return
            try:
                job()
            except BaseException as e:  # noqa: BLE001 - reported through synchronize
                with self._cond:
                    if self._pending_error is None:
                        self._pending_error = e
                    if self._recent_error is None:
                        self._recent_error = e
            with self._cond:
                self._completed += 1
                self._cond.notify_all()

    @property
    def pending_error(self) -> BaseException | None:
        with self._cond:
            return self._pending_error

    def query(self) -> bool:
        with self._cond:
            return self._completed >= self._submitted

    def synchronize(self, timeout: float | None) -> BaseException | None:
        """Wait for the work submitted so far; return (and clear) the pending error."""
        with self._cond:
            target = self._submitted
            if not self._cond.wait_for(lambda: self._completed >= target, timeout):
                raise TimeoutError(
                    f"sim stream still has {target - self._completed} job(s) after {timeout} s"
                )
            err, self._pending_error = self._pending_error, None
            self._recent_error = None
            return err

    def _take_recent(self) -> BaseException | None:
        with self._cond:
            err, self._recent_error = self._recent_error, None
            return err

    def record(self, event: SimEventState) -> None:
        ticket = event.issue()
        self.submit(lambda: event.complete(ticket, self._take_recent()))

    def wait_event(self, event: SimEventState) -> None:
        with event.cond:
            ticket = event.target
        self.submit(lambda: event.wait(ticket))

    def stall(self, seconds: float) -> None:
        self.submit(lambda: time.sleep(seconds))

    def close(self) -> None:
        with self._cond:
            self._jobs.append(None)
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join()
