"""Tracing with OpenTelemetry, set up once per service process from the standard ``OTEL_*``
variables, and the W3C trace context that rides in NATS message headers.

Off unless ``OTEL_TRACES_EXPORTER`` (``otlp`` or ``console``) or an OTLP endpoint
(``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set; ``none`` or
``OTEL_SDK_DISABLED=true`` turn it off. Off, the API's no-op tracer stays installed and the helpers
below return before touching it, so an untraced request pays one boolean test per hop.

``OTEL_EXPORTER_OTLP_PROTOCOL`` picks ``http/protobuf`` (default) or ``grpc``; the sampler,
batching and endpoint variables are read by the SDK and exporters themselves. Each process names
itself ``<prefix>-<service>`` (``tandem-gateway``, ``tandem-decode``…): the prefix is
``OTEL_SERVICE_NAME`` or ``tandem``, so a stack whose processes share one environment still shows
one service name per role.

Traces start at the edge (the gateway, or a client's ``traceparent``): a bus message without trace
context gets no span, so heartbeats, load reports and registry reads never make root spans.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Mapping

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind


_TRACER_NAME = "tandem"
_enabled = False  # process-wide like the OTel provider it mirrors: set once by configure_tracing


def is_enabled() -> bool:
    return _enabled


def wants_tracing(env: Mapping[str, str]) -> bool:
    """Whether the ``OTEL_*`` variables in ``env`` ask for traces."""
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter:
        return exporter != "none"
    return bool(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def service_name(service: str, env: Mapping[str, str]) -> str:
    return f"{env.get('OTEL_SERVICE_NAME') or 'tandem'}-{service}"


def configure_tracing(service: str, env: Mapping[str, str] = os.environ) -> bool:
    """Install an SDK tracer provider exporting this process's spans, if ``env`` asks for it;
    returns whether tracing is on. The provider flushes its batch at interpreter exit."""
    global _enabled
    if not wants_tracing(env):
        return False
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # Resource.create lets OTEL_SERVICE_NAME override service.name: set the per-role name after it
    resource = Resource.create().merge(Resource({SERVICE_NAME: service_name(service, env)}))
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(_exporter(env)))
    trace.set_tracer_provider(provider)
    _enabled = True
    return True


def _exporter(env: Mapping[str, str]):
    kind = env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() or "otlp"
    if kind == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter
        return ConsoleSpanExporter()
    if kind != "otlp":
        raise ValueError(f"OTEL_TRACES_EXPORTER={kind!r}: only otlp, console and none are supported")
    protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "http/protobuf").strip().lower()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
        return GrpcExporter()
    if protocol != "http/protobuf":
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: use http/protobuf or grpc")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
    return HttpExporter()


def tracer() -> trace.Tracer:
    return trace.get_tracer(_TRACER_NAME)


# --- context in message headers -------------------------------------------------------------------
def has_current_span() -> bool:
    return _enabled and trace.get_current_span().get_span_context().is_valid


def current_headers() -> dict[str, str] | None:
    """The current trace context as message headers (``traceparent``…); None when untraced."""
    if not has_current_span():
        return None
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier or None


def remote_context(headers: Mapping[str, str] | None) -> otel_context.Context | None:
    """The trace context a message or HTTP request carries; None when tracing is off or it carries none."""
    if not _enabled or not headers or "traceparent" not in headers:
        return None
    return propagate.extract(headers)


@contextlib.contextmanager
def client_span(name: str, kind: SpanKind = SpanKind.CLIENT, **attributes) -> Iterator[dict[str, str] | None]:
    """A span around sending a message, yielding the headers that carry it (None: untraced, no span)."""
    if not has_current_span():
        yield None
        return
    with tracer().start_as_current_span(name, kind=kind, attributes=attributes):
        yield current_headers()


@contextlib.contextmanager
def server_span(name: str, headers: Mapping[str, str] | None, kind: SpanKind = SpanKind.SERVER,
                **attributes) -> Iterator[Span | None]:
    """A span around handling a message, child of the trace context in its ``headers``; none (and
    None yielded) when the message carries no trace context."""
    parent = remote_context(headers)
    if parent is None:
        yield None
        return
    with tracer().start_as_current_span(name, context=parent, kind=kind, attributes=attributes) as span:
        yield span


# --- spans for phases measured after the fact -----------------------------------------------------
def _epoch_ns(monotonic_s: float) -> int:
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def record_span(name: str, start_monotonic_s: float, end_monotonic_s: float, **attributes) -> None:
    """A child of the current span covering ``[start, end]`` (``time.monotonic`` seconds): for
    phases known only once over, such as a request's wait in the engine's queue."""
    if not has_current_span() or end_monotonic_s < start_monotonic_s:
        return
    span = tracer().start_span(name, start_time=_epoch_ns(start_monotonic_s), attributes=attributes)
    span.end(end_time=_epoch_ns(end_monotonic_s))


def add_event(name: str, **attributes) -> None:
    """A point in time on the current span (the first token of a stream)."""
    if _enabled:
        trace.get_current_span().add_event(name, attributes=attributes)


def trace_id_hex() -> str | None:
    """The current trace's id (32 hex digits), for log lines; None when untraced."""
    ctx = trace.get_current_span().get_span_context()
    return f"{ctx.trace_id:032x}" if ctx.is_valid else None


@contextlib.contextmanager
def edge_span(name: str, headers: Mapping[str, str] | None, **attributes) -> Iterator[Span | None]:
    """The span of a request entering the system (the gateway's HTTP request): a child of the
    client's ``traceparent`` when it sends one, else the root of a new trace. None when off."""
    if not _enabled:
        yield None
        return
    with tracer().start_as_current_span(name, context=remote_context(headers), kind=SpanKind.SERVER,
                                        attributes=attributes) as span:
        yield span


@contextlib.contextmanager
def child_span(name: str, **attributes) -> Iterator[Span | None]:
    """A span inside the current one (a step of the work it covers); none when untraced."""
    if not has_current_span():
        yield None
        return
    with tracer().start_as_current_span(name, attributes=attributes) as span:
        yield span


@contextlib.contextmanager
def untraced() -> Iterator[None]:
    """Outside any trace for the block: for messages sent while serving a request that are not
    part of it (a worker's load report), so that their consumers start no spans in its trace."""
    if not _enabled:
        yield
        return
    token = otel_context.attach(otel_context.Context())
    try:
        yield
    finally:
        otel_context.detach(token)
