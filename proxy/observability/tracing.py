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
replica takes the same decision for a trace. The proxy takes that decision itself before any SDK call, with
the SDK's own rule (the client's sampled flag for parent_based, else the trace id's low 64 bits under the
ratio's bound): an unsampled request (90% at the default ratio) then costs a random number and two
formatted headers (`UnsampledTrace`), not the SDK's non-recording spans and contexts, which cost tens of µs
a request. A sampled root span gets the trace id that was drawn for the decision (`_PresetIds`), so the
SDK's sampler, asked again, answers the same.

With ``--workers N`` build the `Tracing` in each worker after the fork (the exporter thread does not survive
a fork).
"""

from __future__ import annotations

import random
import re
from typing import Any, Mapping, MutableMapping, Sequence
from urllib.parse import urlsplit

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased, Sampler, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from proxy.observability.config import TracingConfig
from proxy.observability.record import GRPC_SERVER_ERRORS

INSTRUMENTATION = "affinity-proxy"
_LOW64 = (1 << 64) - 1
# W3C trace context level 1, as OpenTelemetry's propagator accepts it: version-traceid-parentid-flags.
_TRACEPARENT = re.compile(r"^[ \t]*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?[ \t]*$")


def parse_traceparent(value: str) -> tuple[int, int, int] | None:
    """(trace id, parent span id, flags) of a valid `traceparent`, None for anything the SDK would ignore."""
    m = _TRACEPARENT.match(value)
    if m is None:
        return None
    version, trace_hex, span_hex, flags = m.group(1), m.group(2), m.group(3), m.group(4)
    if version == "ff" or (version == "00" and m.group(5)):
        return None
    trace_id, span_id = int(trace_hex, 16), int(span_hex, 16)
    if not trace_id or not span_id:
        return None
    return trace_id, span_id, int(flags, 16)


class _PresetIds(RandomIdGenerator):
    """The SDK's id generator, except that the next root trace id can be the one the proxy already drew."""

    def __init__(self) -> None:
        self.next_trace_id = 0

    def generate_trace_id(self) -> int:
        trace_id = self.next_trace_id
        if trace_id:
            self.next_trace_id = 0
            return trace_id
        return super().generate_trace_id()


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
        self._ids = _PresetIds()
        self.provider = TracerProvider(sampler=build_sampler(config), id_generator=self._ids,
                                       resource=Resource.create({"service.name": config.service_name}))
        # The sampling rule, applied before any SDK call (module doc): TraceIdRatioBased's bound on the low
        # 64 bits of the trace id (0: never, 2^64: always), and whether a client's sampled flag decides.
        if config.sampler == "always_on":
            self._bound = 1 << 64
        elif config.sampler == "always_off":
            self._bound = 0
        else:
            self._bound = TraceIdRatioBased(config.ratio).bound
        self._follow_parent = config.sampler == "parent_based"
        self._never = config.sampler == "always_off"
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
              client: str | None = None, model: str | None = None,
              session: str | None = None) -> "RequestTrace | UnsampledTrace":
        """The server span of one request, continuing the client's `traceparent` when it sent one; an
        `UnsampledTrace` (no SDK call at all) when the sampler drops the trace.

        `headers` is anything with a case-insensitive or lower-case `.get` (aiohttp's headers, a dict built
        from h2 headers)."""
        value = headers.get("traceparent")
        client_parent = parse_traceparent(value) if value else None
        if client_parent is not None:
            trace_id = client_parent[0]
            if self._never:
                sampled = False
            elif self._follow_parent:
                sampled = bool(client_parent[2] & 1)
            else:
                sampled = (trace_id & _LOW64) < self._bound
        else:
            trace_id = random.getrandbits(128) or 1
            sampled = (trace_id & _LOW64) < self._bound
        if not sampled:
            return UnsampledTrace(trace_id, headers.get("tracestate") if client_parent is not None else None)
        if client_parent is None:
            self._ids.next_trace_id = trace_id  # the root span gets the id the decision was taken on
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

    def set_attribute(self, key: str, value: Any) -> None:
        self.span.set_attribute(key, value)

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


class _NoAttempt:
    __slots__ = ()

    def first_byte(self) -> None:
        return None

    def finish(self, status: int | None = None, grpc_status: int | None = None, error: str | None = None) -> None:
        return None


_NO_ATTEMPT = _NoAttempt()


class UnsampledTrace:
    """A trace the sampler dropped: no spans, only the W3C context passed on to the backend, with the
    sampled flag off (its parent id is a fresh span id, as the SDK's non-recording span would have)."""

    __slots__ = ("_trace_hex", "_tracestate")
    sampled = False

    def __init__(self, trace_id: int, tracestate: str | None = None) -> None:
        self._trace_hex = f"{trace_id:032x}"
        self._tracestate = tracestate

    @property
    def trace_id(self) -> str:
        return self._trace_hex

    def routed(self, policy: str, reason: str, backend: str, alternates: Sequence[str] = (),
               prefix_blocks_matched: int = 0, load_score: float | None = None,
               start_time_ns: int | None = None) -> None:
        return None

    def attempt(self, backend: str, url: str, attempt: int, headers: MutableMapping[str, str]) -> _NoAttempt:
        headers["traceparent"] = f"00-{self._trace_hex}-{random.getrandbits(64) or 1:016x}-00"
        if self._tracestate:
            headers["tracestate"] = self._tracestate
        return _NO_ATTEMPT

    def event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None:
        return None

    def set_attribute(self, key: str, value: Any) -> None:
        return None

    def finish(self, status: int, grpc_status: int | None = None, error: str | None = None,
               attempts: int | None = None) -> None:
        return None


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
