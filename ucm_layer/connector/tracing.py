"""OpenTelemetry spans per request: ``kvfabric.lookup``, ``kvfabric.load``, ``kvfabric.dump``.

Spans carry ``requested_tokens``, ``hit_tokens`` and ``hit_rate``; load and dump spans
also ``blocks`` and ``bytes`` (one span per request: a batched transfer of several
requests gives each of them a span over the batch's time). They are exported only when
an OTLP endpoint is configured (``otlp_endpoint`` in the connector config, or
``OTEL_EXPORTER_OTLP_ENDPOINT``) and the ``otel`` extra is installed; otherwise every
call is a no-op costing one attribute check. The exporter is set up once per process.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

log = logging.getLogger("kvfabric.connector")

_lock = threading.Lock()
_tracers: dict[str, Any] = {}


class _NoSpan:
    def set(self, **attrs: Any) -> None:
        pass


class _Span:
    def __init__(self, span: Any) -> None:
        self._span = span

    def set(self, **attrs: Any) -> None:
        for k, v in attrs.items():
            self._span.set_attribute(k, v)


def _otel_tracer(endpoint: str) -> Any:
    with _lock:
        if endpoint in _tracers:
            return _tracers[endpoint]
        tracer = None
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            url = endpoint.rstrip("/")
            if not url.endswith("/v1/traces"):
                url += "/v1/traces"
            provider = TracerProvider(resource=Resource.create({"service.name": "kvfabric"}))
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
            tracer = provider.get_tracer("kvfabric")
            log.info("kvfabric: exporting OpenTelemetry spans to %s", url)
        except ImportError as e:
            log.warning(
                "kvfabric: otlp_endpoint is set but OpenTelemetry is not installed (%s); "
                "pip install 'kvfabric[otel]'",
                e,
            )
        _tracers[endpoint] = tracer
        return tracer


class Tracer:
    """Makes spans when an endpoint is configured, nothing otherwise."""

    def __init__(self, endpoint: str | None, tracer: Any = None) -> None:
        self._tracer = tracer if tracer is not None else (_otel_tracer(endpoint) if endpoint else None)

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def record(self, name: str, start_ns: int, end_ns: int, **attrs: Any) -> None:
        """A finished span from ``start_ns`` to ``end_ns`` (``time.time_ns`` clock)."""
        if self._tracer is None:
            return
        s = self._tracer.start_span(name, start_time=start_ns)
        for k, v in attrs.items():
            s.set_attribute(k, v)
        s.end(end_time=end_ns)

    @contextlib.contextmanager
    def span(self, name: str, **attrs: Any) -> Iterator[_NoSpan | _Span]:
        if self._tracer is None:
            yield _NoSpan()
            return
        with self._tracer.start_as_current_span(name) as s:
            out = _Span(s)
            out.set(**attrs)
            yield out
