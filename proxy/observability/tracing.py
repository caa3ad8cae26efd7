"""OpenTelemetry spans for the request lifecycle: server span, routing span, one client span per attempt.

Nothing of this runs when tracing is off: `build_tracing` answers None and the lifecycle guards each call
with ``if tracing is not None`` (one attribute test per step; OpenTelemetry is only imported at start-up).
When on, spans are handed to a BatchSpanProcessor, whose own thread exports them over OTLP/HTTP; the
request path only records.

Shape of one request's trace (the W3C `traceparent`/`tracestate` of the client continued when present):

    <method or gRPC method>   SERVER    http.request.method, url.path, network.protocol.name, client.address,
      │                                 rpc.system/service/method (gRPC), gen_ai.request.model, affinity.*;
      │                                 events first_byte / first_token / end; status
      ├─ route                INTERNAL  affinity.policy, .reason, .backend, .prefix_blocks_matched,
      │                                 .load_score, .alternates
      └─ upstream <backend>   CLIENT    affinity.backend, affinity.attempt, server.address/port,
                                        http.response.status_code / rpc.grpc.status_code, error.type;
                                        event first_byte. Its context is injected into the backend request.

Sampling is decided once per trace from the trace id (TraceIdRatioBased), so every worker process and
replica takes the same decision for a trace.

With ``--workers N`` build the `Tracing` in each worker after the fork (the exporter thread does not survive
a fork).
"""

from __future__ import annotations

from typing import Any, Mapping, MutableMapping, Sequence
from urllib.parse import urlsplit

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased, Sampler, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from proxy.observability.config import TracingConfig
from proxy.observability.record import GRPC_SERVER_ERRORS

INSTRUMENTATION = "affinity-proxy"


def build_sampler(config: TracingConfig) -> Sampler:
    if config.sampler == "always_on":
        return ALWAYS_ON
    if config.sampler == "always_off":
        return ALWAYS_OFF
    ratio = TraceIdRatioBased(config.ratio)
    return ratio if config.sampler == "ratio" else ParentBased(ratio)


class Tracing:
    """A tracer provider with its exporter; `start` opens the trace of one request."""

    def __init__(self, config: TracingConfig, exporter: SpanExporter | None = None, batch: bool = True) -> None:
        """`exporter` defaults to OTLP/HTTP at `config.endpoint`; tests pass an in-memory one (and
        ``batch=False`` to export each span as it ends)."""
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=config.endpoint, headers=dict(config.headers) or None,
                                        timeout=config.export_timeout_s)
        self.config = config
        self.provider = TracerProvider(sampler=build_sampler(config),
                                       resource=Resource.create({"service.name": config.service_name}))
        if batch:
            processor: Any = BatchSpanProcessor(exporter, max_queue_size=config.max_queue,
                                                schedule_delay_millis=config.batch_delay_ms,
                                                export_timeout_millis=config.export_timeout_s * 1000)
        else:
            processor = SimpleSpanProcessor(exporter)
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer(INSTRUMENTATION)
        self.propagator = TraceContextTextMapPropagator()

    def start(self, headers: Mapping[str, str], name: str, protocol: str, method: str, path: str,
              client: str | None = None, model: str | None = None, session: str | None = None) -> "RequestTrace":
        """The server span of one request, continuing the client's `traceparent` when it sent one.

        `headers` is anything with a case-insensitive or lower-case `.get` (aiohttp's headers, a dict built
        from h2 headers)."""
        parent = self.propagator.extract(headers)
        attrs: dict[str, Any] = {"network.protocol.name": "grpc" if protocol == "grpc" else "http",
                                 "affinity.protocol": protocol, "http.request.method": method, "url.path": path}
        if protocol == "grpc":
            service, _, rpc_method = path.lstrip("/").partition("/")
            attrs.update({"rpc.system": "grpc", "rpc.service": service, "rpc.method": rpc_method})
        else:
            attrs["network.protocol.version"] = "2" if protocol == "h2" else "1.1"
        if client:
            host, _, port = client.rpartition(":")
            attrs["client.address"] = host or client
            if port.isdigit():
                attrs["client.port"] = int(port)
        if model:
            attrs["gen_ai.request.model"] = model
        if session:
            attrs["affinity.session"] = session
        span = self.tracer.start_span(name, context=parent, kind=SpanKind.SERVER, attributes=attrs)
        return RequestTrace(self, span)

    def force_flush(self, timeout_ms: int = 10_000) -> bool:
        return self.provider.force_flush(timeout_ms)

    def shutdown(self) -> None:
        self.provider.shutdown()


def build_tracing(config: TracingConfig, exporter: SpanExporter | None = None) -> Tracing | None:
    """None when tracing is off: the lifecycle then skips every tracing call."""
    return Tracing(config, exporter) if config.enabled else None


class RequestTrace:
    """The spans of one request. Calls after `finish` are ignored by OpenTelemetry (ended spans)."""

    __slots__ = ("_tracing", "span", "_context")

    def __init__(self, tracing: Tracing, span: Span) -> None:
        self._tracing = tracing
        self.span = span
        self._context = set_span_in_context(span)

    @property
    def trace_id(self) -> str:
        """32 hex digits, for the access log (set even when the trace is not sampled)."""
        return f"{self.span.get_span_context().trace_id:032x}"

    @property
    def sampled(self) -> bool:
        return self.span.get_span_context().trace_flags.sampled

    def routed(self, policy: str, reason: str, backend: str, alternates: Sequence[str] = (),
               prefix_blocks_matched: int = 0, load_score: float | None = None,
               start_time_ns: int | None = None) -> None:
        """The routing decision as a child span (ends now; `start_time_ns` = when the pick began)."""
        if not self.span.is_recording():
            return
        attrs: dict[str, Any] = {"affinity.policy": policy, "affinity.reason": reason, "affinity.backend": backend,
                                 "affinity.alternates": list(alternates),
                                 "affinity.prefix_blocks_matched": prefix_blocks_matched}
        if load_score is not None:
            attrs["affinity.load_score"] = load_score
        self._tracing.tracer.start_span("route", context=self._context, attributes=attrs,
                                        start_time=start_time_ns).end()
        self.span.set_attribute("affinity.backend", backend)
        self.span.set_attribute("affinity.reason", reason)

    def attempt(self, backend: str, url: str, attempt: int, headers: MutableMapping[str, str]) -> "AttemptTrace":
        """A client span for one upstream attempt; its traceparent (and the client's tracestate) is written
        into `headers`, the request about to go to the backend (replace any client-sent copy)."""
        parts = urlsplit(url)
        attrs: dict[str, Any] = {"affinity.backend": backend, "affinity.attempt": attempt}
        if parts.hostname:
            attrs["server.address"] = parts.hostname
        if parts.port:
            attrs["server.port"] = parts.port
        span = self._tracing.tracer.start_span(f"upstream {backend}", context=self._context, kind=SpanKind.CLIENT,
                                               attributes=attrs)
        self._tracing.propagator.inject(headers, context=set_span_in_context(span))
        return AttemptTrace(span)

    def event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None:
        """A streaming milestone on the server span: first_byte, first_token, end."""
        self.span.add_event(name, attributes=dict(attributes) if attributes else None)

    def finish(self, status: int, grpc_status: int | None = None, error: str | None = None,
               attempts: int | None = None) -> None:
        span = self.span
        if span.is_recording():
            span.set_attribute("http.response.status_code", status)
            if grpc_status is not None:
                span.set_attribute("rpc.grpc.status_code", grpc_status)
            if attempts is not None:
                span.set_attribute("affinity.attempts", attempts)
            if error is not None:
                span.set_attribute("error.type", error)
            if status >= 500 or error is not None or grpc_status in GRPC_SERVER_ERRORS:
                span.set_status(Status(StatusCode.ERROR, error or (f"grpc status {grpc_status}"
                                                                   if grpc_status else f"HTTP {status}")))
            span.add_event("end")
        span.end()


class AttemptTrace:
    __slots__ = ("span",)

    def __init__(self, span: Span) -> None:
        self.span = span

    def first_byte(self) -> None:
        self.span.add_event("first_byte")

    def finish(self, status: int | None = None, grpc_status: int | None = None, error: str | None = None) -> None:
        span = self.span
        if span.is_recording():
            if status is not None:
                span.set_attribute("http.response.status_code", status)
            if grpc_status is not None:
                span.set_attribute("rpc.grpc.status_code", grpc_status)
            if error is not None:
                span.set_attribute("error.type", error)
            if error is not None or (status is not None and status >= 500) or grpc_status in GRPC_SERVER_ERRORS:
                span.set_status(Status(StatusCode.ERROR, error or f"HTTP {status}"))
        span.end()
