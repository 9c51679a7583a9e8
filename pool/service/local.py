"""``LocalTransport``: the in-process transport of an embedded pool (calls go straight to
the dispatcher, no socket). Service side: a client reaches it only when it asks for an
embedded pool (``kvfabric.pool.EmbeddedPool``)."""

from __future__ import annotations

import os
from typing import Any

from kvfabric.pool import protocol as p
from kvfabric.pool.client.rpc import checked
from kvfabric.pool.service.dispatch import Dispatcher


class LocalTransport:
    """The embedded pool: calls go straight to the dispatcher."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher

    def call(self, req: Any) -> p.Reply:
        return checked(self.dispatcher.handle(req, os.getpid()))  # lives as long as the service

    def close(self) -> None:
        pass
