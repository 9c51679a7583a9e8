"""Disaggregated prefill (P/D): the producer's announcement and the consumer's wait.

A producer engine (``kv_producer``) prefills a request asked to hand off
(``do_remote_decode`` in its ``kv_transfer_params``); when it finishes, ``params`` answers
vLLM's ``request_finished`` with the parameters for the decode engine:
``do_remote_prefill`` and, under ``kvfabric``, how many full blocks were planned as dumps
and the ``fingerprint`` of their ids (a digest of what names a block: model, dtype, block
size, TP size, KV layout). The consumer engine (``kv_consumer``) reads them once per
request (``announce``): a fingerprint that differs from its own means the blocks cannot
be used (warned once, the request is computed); otherwise it waits, up to ``wait_s``
(``pd_wait_s``), for the announced blocks to reach the store: its lookup answers "not
decided yet" (``None``, vLLM asks again next step) while they are short, and asks the
store at most every 5 ms meanwhile (``throttled``). After ``wait_s`` it loads what is
there and computes the rest (warned once).

Contract (the scheduler role, per request; what mutates): each request's wait state is a
:class:`PDWait` the scheduler keeps with the request (and drops with it). In
``get_num_new_matched_tokens``: ``announce(w, view)`` first, then the lookup (fresh while
``w.announced``; ``asked(w)`` on each store lookup; ``waiting(w)`` says whether the lookup
counts in the hit statistics yet), then ``settle(w, req_id, have)`` with the blocks the
engine holds or found: False while the consumer waits on, True once decided (then
``w.announced`` is 0). ``params`` is called from ``request_finished``. Not thread-safe:
vLLM calls the scheduler role from one thread; ``clock`` is ``time.monotonic`` but for
tests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvfabric.ucm_layer.connector.views import ReqView

log = logging.getLogger("kvfabric.connector")

#: how often a waiting consumer asks the store again, at most
ASK_EVERY_S = 0.005


@dataclass
class PDWait:
    """A consumer request's wait: the full blocks its producer announced (0: none, or
    decided), when the wait began, and when the store was last asked."""

    announced: int = 0
    since: float | None = None
    last_ask: float = 0.0


class Handoff:
    """The P/D hand-off of one scheduler role (see module docstring)."""

    def __init__(
        self, fingerprint: str, wait_s: float, block_size: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.fingerprint, self.wait_s, self.block_size = fingerprint, wait_s, block_size
        self._clock = clock
        self._told: set[str] = set()  # warnings already logged

    def announce(self, w: PDWait, view: ReqView) -> None:
        """Read the producer's hand-off from ``view.transfer_params``, once per request."""
        params = view.transfer_params
        if w.since is not None or w.announced or not params or not params.get("do_remote_prefill"):
            return
        mine = params.get("kvfabric")
        if not isinstance(mine, Mapping):
            return
        fp = str(mine.get("fingerprint", ""))
        if self.fingerprint and fp != self.fingerprint:
            self._tell(
                "fingerprint",
                "kvfabric: P/D request %s was prefilled by an engine whose block ids differ from this "
                "one's (fingerprint %s, here %s: another model, dtype, block size, TP size or KV layout); "
                "its blocks cannot be used and it is computed here (logged once)",
                view.req_id,
                fp or "none",
                self.fingerprint,
            )
            return
        try:
            blocks = int(mine.get("blocks", 0))
        except (TypeError, ValueError):
            blocks = 0
        claimable = max(view.num_tokens - 1, 0) // self.block_size
        w.announced = max(0, min(blocks, claimable))

    def waiting(self, w: PDWait) -> bool:
        """Whether the request still waits for announced blocks (its lookups do not count yet)."""
        return w.announced > 0 and (w.since is None or self._clock() - w.since < self.wait_s)

    def throttled(self, w: PDWait) -> bool:
        """Whether the store was asked for this request less than ``ASK_EVERY_S`` ago."""
        return self._clock() - w.last_ask < ASK_EVERY_S

    def asked(self, w: PDWait) -> None:
        w.last_ask = self._clock()

    def settle(self, w: PDWait, req_id: str, have: int) -> bool:
        """With ``have`` blocks in the engine or the store: False while fewer than announced
        and ``wait_s`` has not passed (vLLM asks again); else True, the wait decided."""
        if not w.announced:
            return True
        if have < w.announced:
            if w.since is None:
                w.since = self._clock()
            if self._clock() - w.since < self.wait_s:
                return False
            self._tell(
                "late",
                "kvfabric: P/D request %s: %d of the %d blocks its producer announced are not in the "
                "store after pd_wait_s=%gs; computing the rest (logged once)",
                req_id,
                w.announced - have,
                w.announced,
                self.wait_s,
            )
        w.announced = 0  # decided: load what is there
        return True

    def params(self, params: Mapping[str, Any] | None, stored: int) -> dict[str, Any] | None:
        """For a prefill asked to hand off: the decode engine's ``kv_transfer_params``
        (``stored``: the full blocks planned as dumps); None for any other request."""
        if not params or not params.get("do_remote_decode"):
            return None
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "kvfabric": {"blocks": stored, "fingerprint": self.fingerprint},
        }

    def _tell(self, key: str, msg: str, *args: object) -> None:
        if key not in self._told:
            self._told.add(key)
            log.warning(msg, *args)
