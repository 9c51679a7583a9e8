"""OpenTelemetry spans of the connector: one trace per request, across vLLM's processes.

Spans (names and attributes are what ``docs/vllm.md`` and ``docs/observability.md`` list):

* ``kvfabric.request`` (scheduler): the root, from the request's first lookup (or, in an
  engine that only stores, its first allocation) to its end: ``request_finished`` when the
  connector keeps none of its blocks, else the step whose worker output reports its dumps
  released (vLLM's ``finished_sending``). Attributes ``req_id``, ``requested_tokens``,
  ``hit_tokens``, ``hit_rate`` (of its last lookup), ``store`` (the pipeline),
  ``sparse_algorithm`` (when one is configured), ``stored_blocks`` (dumps planned).
* ``kvfabric.lookup`` (scheduler, child of the root): one per question the store was
  really asked (repeated questions are answered from the last lookup and make no span):
  ``requested_tokens``, ``hit_tokens``, ``hit_rate``, ``store_tier`` (the tier the index
  reads: the lowest one, or the worker's whole pipeline in a one-process engine).
* ``kvfabric.load`` (worker, child of the root): from the load's issue to its end (an
  asynchronous load: the step that saw it end): ``blocks``, ``bytes`` (the good ones),
  ``requested_tokens``, ``hit_tokens``, ``hit_rate``, ``store_tier`` (``cache`` when the
  cache tier held every block at issue, the lower tier's name when it held none, the
  pipeline's name for a mix).
* ``kvfabric.dump`` (worker, child of the root): from the dump's issue until its statuses
  are in (all layers, layer-wise): ``blocks``, ``bytes`` (stored), ``store_tier``.
* ``kvfabric.sparse`` (worker, child of the root; with a sparse algorithm): from the
  request's first sparse selection to the end of its last, ``sparse_algorithm``,
  ``selection_s`` (seconds the request's selections took, its share of each batch),
  ``sparse_layer_steps``; reported when the request ends.

A batched transfer of several requests gives each of them a span over the batch's time.

Crossing processes: the scheduler and the worker are different processes under vLLM's
default multiprocessing, so the step plan carries each request's root as a W3C
``traceparent`` string (``StepPlan.traces``); the worker parents its spans on it, so
both processes' spans form one trace (each process exports its own).

When tracing is on: an OTLP endpoint is configured (``otlp_endpoint`` in the connector
config, or ``OTEL_EXPORTER_OTLP_ENDPOINT``) and the ``otel`` extra is installed, or a
process installed an OpenTelemetry ``TracerProvider`` with :func:`use_tracer_provider`
before the connector was built (tests, applications that run vLLM in process and export
their own spans). Otherwise every call costs one attribute check, nothing is imported,
and the plan carries no trace context. The OTLP exporter is set up once per process (resource
``service.name=kvfabric`` and the exporting process's ``process.pid``), with the SDK's
batching processor (``OTEL_BSP_*`` variables tune it).

Not thread-safe beyond the OpenTelemetry SDK's own guarantees: each role calls its
:class:`RequestSpans` / :class:`Tracer` from vLLM's one thread of that role.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("kvfabric.connector")

_lock = threading.Lock()
_tracers: dict[str, Any] = {}
_installed: Any = None  # the tracer of use_tracer_provider, or None

ROOT = "kvfabric.request"
LOOKUP = "kvfabric.lookup"
LOAD = "kvfabric.load"
DUMP = "kvfabric.dump"
SPARSE = "kvfabric.sparse"


def use_tracer_provider(provider: Any) -> None:
    """Make connectors built from now on in this process trace into ``provider`` (an
    OpenTelemetry ``TracerProvider``), whatever their ``otlp_endpoint``; None undoes it.
    Connectors already built keep their tracer."""
    global _installed
    _installed = provider.get_tracer("kvfabric") if provider is not None else None


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
            resource = Resource.create({"service.name": "kvfabric", "process.pid": os.getpid()})
            provider = TracerProvider(resource=resource)
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


def _context(parent: Any) -> Any:
    """An OpenTelemetry context whose current span is ``parent``: a live span of this
    process, or a ``traceparent`` string from another one (None: no parent)."""
    from opentelemetry import trace

    if parent is None or parent == "":
        return None
    if isinstance(parent, str):
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        return TraceContextTextMapPropagator().extract({"traceparent": parent})
    return trace.set_span_in_context(parent)


def traceparent(span: Any) -> str:
    """The W3C ``traceparent`` of a live span (what the step plan carries)."""
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent", "")


class Tracer:
    """Makes spans when tracing is on (see the module docstring), nothing otherwise."""

    def __init__(self, endpoint: str | None, tracer: Any = None) -> None:
        if tracer is None:
            tracer = _otel_tracer(endpoint) if endpoint else _installed
        self._tracer = tracer

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def start(self, name: str, start_ns: int, parent: Any = None, **attrs: Any) -> Any:
        """A started span (the caller ends it with ``span.end(end_time=...)``); None when off."""
        if self._tracer is None:
            return None
        s = self._tracer.start_span(name, context=_context(parent), start_time=start_ns)
        for k, v in attrs.items():
            s.set_attribute(k, v)
        return s

    def record(self, name: str, start_ns: int, end_ns: int, parent: Any = None, **attrs: Any) -> None:
        """A finished span from ``start_ns`` to ``end_ns`` (``time.time_ns`` clock), child of
        ``parent`` (a live span or a ``traceparent`` string; None: a root of its own)."""
        s = self.start(name, start_ns, parent, **attrs)
        if s is not None:
            s.end(end_time=max(end_ns, start_ns))

    @contextlib.contextmanager
    def span(self, name: str, **attrs: Any) -> Iterator[_NoSpan | _Span]:
        if self._tracer is None:
            yield _NoSpan()
            return
        with self._tracer.start_as_current_span(name) as s:
            out = _Span(s)
            out.set(**attrs)
            yield out


@dataclass
class _Root:
    span: Any
    parent: str  # its traceparent
    waiting: bool = False  # finished; ends when the workers report its dumps released
    attrs: dict[str, Any] = field(default_factory=dict)


class RequestSpans:
    """The scheduler's root spans, one per request (see the module docstring).

    Call order per request: ``begin`` (first seen; idempotent), any number of ``lookup``
    and ``set``, then ``finish(keep)``: without kept blocks the root ends there, else it
    ends in ``released`` (the worker output's ``finished_sending``). ``traceparent`` is
    the root's context for the step plan ("" for an unknown request). ``forget`` ends a
    root at once. Roots are bounded (``max_open``: the oldest is ended past it), so a
    request vLLM never finishes cannot grow this without end.
    """

    def __init__(self, tracer: Tracer, attrs: Mapping[str, Any] | None = None, max_open: int = 65536) -> None:
        self.tracer = tracer
        self.attrs = dict(attrs or {})
        self.max_open = max_open
        self._open: dict[str, _Root] = {}

    @property
    def enabled(self) -> bool:
        return self.tracer.enabled

    def begin(self, req_id: str, requested_tokens: int) -> None:
        if not self.tracer.enabled or req_id in self._open:
            return
        span = self.tracer.start(
            ROOT,
            time.time_ns(),
            req_id=req_id,
            requested_tokens=requested_tokens,
            hit_tokens=0,
            hit_rate=0.0,
            **self.attrs,
        )
        self._open[req_id] = _Root(span, traceparent(span))
        if len(self._open) > self.max_open:
            self._end(next(iter(self._open)))

    def traceparent(self, req_id: str) -> str:
        root = self._open.get(req_id)
        return root.parent if root is not None else ""

    def lookup(self, req_id: str, start_ns: int, end_ns: int, **attrs: Any) -> None:
        """A lookup span under the request's root; its hit figures become the root's too."""
        root = self._open.get(req_id)
        if root is None:
            return
        self.tracer.record(LOOKUP, start_ns, end_ns, root.span, req_id=req_id, **attrs)
        self.set(req_id, **{k: v for k, v in attrs.items() if k != "store_tier"})

    def set(self, req_id: str, **attrs: Any) -> None:
        root = self._open.get(req_id)
        if root is not None:
            for k, v in attrs.items():
                root.span.set_attribute(k, v)

    def finish(self, req_id: str, keep: bool) -> None:
        """vLLM finished the request; ``keep``: the workers still hold its blocks for dumps."""
        root = self._open.get(req_id)
        if root is None:
            return
        if keep:
            root.waiting = True
        else:
            self._end(req_id)

    def released(self, req_ids: Any) -> None:
        """The workers report these requests' dumps released their blocks (all ranks)."""
        for r in req_ids or ():
            root = self._open.get(r)
            if root is not None and root.waiting:
                self._end(r)

    def forget(self, req_id: str) -> None:
        if req_id in self._open:
            self._end(req_id)

    def _end(self, req_id: str) -> None:
        root = self._open.pop(req_id)
        root.span.end(end_time=time.time_ns())

    def close(self) -> None:
        for r in list(self._open):
            self._end(r)

    def __len__(self) -> int:
        return len(self._open)
