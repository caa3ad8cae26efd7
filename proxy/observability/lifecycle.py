"""The request lifecycle's one hook into observability: an `Observability` given to each data plane, and
one `RequestObservation` per request that fills the `RequestRecord` and drives the trace.

Every protocol does the same few calls (proxy/dataplane/openai.py for HTTP/1.1 and the HTTP/2 bridge,
proxy/grpc/call.py for gRPC):

    ob = observability.begin(request_id, protocol, method, path, client, header_get, received_at)  # admit
    ob.summarised(summary)                    # model, adapter, session known
    ob.picked(lease, url)                     # each attempt's pick: record + on_pick, route and client span
    ob.first_byte()                           # the backend's first response byte
    ob.attempt_failed(...)                    # an attempt that is retried elsewhere
    ob.finish(status, grpc_status, error, bytes_out=..., body=...)   # once: access log, windows, span end
    ob.finish_as_recorded()                   # or: once, with what the record holds already

A data plane built without observability (access log, hot spots and tracing all off) holds None and makes
none of these calls. With tracing off (`tracing` None) no span code runs at all: only the record is filled.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from proxy.core.request import RequestSummary
from proxy.metrics import ProxyMetrics
from proxy.observability.observer import Observer
from proxy.observability.record import RequestRecord
from proxy.observability.tracing import AttemptTrace, RequestTrace, Tracing, UnsampledTrace, _NoAttempt

# The client's W3C trace context: continued by the server span, never forwarded as the client sent it
# (the backend gets the upstream span's own traceparent instead).
TRACE_HEADERS = frozenset({b"traceparent", b"tracestate"})

HeaderGet = Callable[[str], "str | None"]


class Observability:
    """The observer (access log + hot-spot windows; None when both are off) and the tracing (None when off)."""

    __slots__ = ("observer", "tracing", "metrics")

    def __init__(self, observer: Observer | None, tracing: Tracing | None,
                 metrics: ProxyMetrics | None = None) -> None:
        """`metrics`: where each request's time to first byte goes (the TTFT histogram by backend)."""
        self.observer = observer
        self.tracing = tracing
        self.metrics = metrics

    @property
    def active(self) -> bool:
        return self.observer is not None or self.tracing is not None

    def begin(self, request_id: str, protocol: str, method: str, path: str, client: str | None,
              header_get: HeaderGet, received_at: float, bytes_in: int = 0,
              session: str | None = None) -> "RequestObservation":
        record = RequestRecord(request_id=request_id, client=client, protocol=protocol, method=method, path=path,
                               bytes_in=bytes_in, session=session)
        trace = None
        tracing = self.tracing
        if tracing is not None:
            name = path if protocol == "grpc" else f"{method} {path}"
            carrier = {k: v for k in ("traceparent", "tracestate") if (v := header_get(k)) is not None}
            trace = tracing.start(carrier, name, protocol, method, path, client=client, session=session)
            record.trace_id = trace.trace_id
        return RequestObservation(self, record, trace, received_at)


class RequestObservation:
    __slots__ = ("observer", "metrics", "record", "trace", "attempt", "received_at", "_finished")

    def __init__(self, observability: Observability, record: RequestRecord, trace: RequestTrace | UnsampledTrace | None,
                 received_at: float) -> None:
        self.observer = observability.observer
        self.metrics = observability.metrics
        self.record = record
        self.trace = trace
        self.attempt: AttemptTrace | _NoAttempt | None = None
        self.received_at = received_at  # time.monotonic() when the request's head arrived
        self._finished = False

    def summarised(self, summary: RequestSummary) -> None:
        r = self.record
        r.model = summary.model
        r.adapter = summary.adapter
        if summary.session_key is not None:
            r.session = summary.session_key
        trace = self.trace
        if trace is not None and summary.model and trace.sampled:
            trace.set_attribute("gen_ai.request.model", summary.model)
            if summary.session_key:
                trace.set_attribute("affinity.session", summary.session_key)

    def picked(self, lease: Any, url: str) -> Sequence[tuple[bytes, bytes]]:
        """One attempt's pick (`lease`: proxy.dataplane.router.Lease). Returns the trace-context headers the
        backend request must carry (empty with tracing off)."""
        r = self.record
        decision = lease.decision
        backend = lease.backend
        name = decision.backend
        r.backend = name
        r.policy = decision.policy
        r.reason = decision.reason._value_  # the Enum's plain attribute: `.value` is a slow descriptor on 3.11
        r.load_score = backend.load_score
        r.inflight = lease.router.inflight.requests(name)
        r.kv_holder = decision.kv_holder
        r.kv_cached = decision.kv_cached
        r.attempts += 1
        r.ttft_s = None  # a retried attempt: the first byte that counts is the answering one's
        r.error = None
        observer = self.observer
        if observer is not None:
            observer.on_pick(r)
        trace = self.trace
        if trace is None:
            return ()
        if self.attempt is not None:  # the previous attempt ended without saying how (cancelled)
            self.attempt.finish(error="abandoned")
        if trace.sampled:
            snapshot = lease.router.store.current
            excluded = lease.exclude
            alternates = [b.name for b in snapshot.backends
                          if b.name != name and b.name not in excluded and b.routable]
            trace.routed(decision.policy, r.reason, name, alternates, decision.prefix_blocks_matched,
                         backend.load_score)
        carrier: dict[str, str] = {}
        self.attempt = trace.attempt(name, url, r.attempts, carrier)
        return [(k.encode("latin-1"), v.encode("latin-1")) for k, v in carrier.items()]

    def first_byte(self) -> None:
        r = self.record
        if r.ttft_s is None:
            r.ttft_s = time.monotonic() - self.received_at
            if self.attempt is not None:
                self.attempt.first_byte()
            if self.trace is not None:
                self.trace.event("first_byte")

    def attempt_failed(self, status: int | None = None, grpc_status: int | None = None,
                       error: str | None = None) -> None:
        """The current attempt failed and another may follow (its client span ends here)."""
        attempt = self.attempt
        if attempt is not None:
            self.attempt = None
            attempt.finish(status, grpc_status, error)

    def answered(self, answer: Any, error: str | None = None) -> None:
        """A whole answer (proxy.dataplane.openai.Answer) is about to go to the client."""
        r = self.record
        r.status = answer.status
        body = answer.body
        r.bytes_out = len(body)
        if error is not None:
            r.error = error
        observer = self.observer
        if answer.status < 300 and body and observer is not None and observer.access_log is not None:
            r.prompt_tokens, r.cached_tokens = usage_of(body)  # only the access log shows them

    def finish(self, status: int, grpc_status: int | None = None, error: str | None = None, *,
               bytes_out: int = 0, body: bytes | None = None) -> None:
        """Once per request (later calls are ignored): the record goes to the observer, the spans end."""
        if self._finished:
            return
        r = self.record
        r.status = status
        r.grpc_status = grpc_status
        r.error = error
        if bytes_out:
            r.bytes_out = bytes_out
        if body:
            r.prompt_tokens, r.cached_tokens = usage_of(body)
        self.finish_as_recorded()

    def finish_as_recorded(self) -> None:
        """`finish` with the status, gRPC status, error and bytes the record holds already (the usual HTTP
        end: a whole answer, or a stream, filled them in as it went); later calls are ignored."""
        if self._finished:
            return
        self._finished = True
        r = self.record
        r.duration_s = time.monotonic() - self.received_at
        trace = self.trace
        if trace is not None:
            status, grpc_status, error = r.status, r.grpc_status, r.error
            attempt = self.attempt
            if attempt is not None:
                self.attempt = None
                attempt.finish(status if r.backend is not None else None, grpc_status, error)
            trace.finish(status, grpc_status, error, r.attempts)
        if r.ttft_s is not None and r.backend is not None and self.metrics is not None:
            self.metrics.first_byte(r.backend, r.ttft_s)
        observer = self.observer
        if observer is not None:
            observer.on_finish(r)


def strip_trace_headers(raw: Sequence[tuple[bytes, bytes]]) -> tuple[tuple[bytes, bytes], ...]:
    """The client's headers without its own traceparent/tracestate (the upstream span's replace them)."""
    return tuple(h for h in raw if h[0].lower() not in TRACE_HEADERS)


def _int_after(body: bytes, i: int) -> int | None:
    n = len(body)
    while i < n and body[i] in b' \t\r\n:':
        i += 1
    j = i
    while j < n and 48 <= body[j] <= 57:
        j += 1
    return int(body[i:j]) if j > i else None


def usage_of(body: bytes) -> tuple[int | None, int | None]:
    """usage.prompt_tokens and usage.prompt_tokens_details.cached_tokens of an OpenAI answer (the last ones
    in the body: a streamed answer's usage chunk comes last), found without parsing the whole JSON."""
    i = body.rfind(b'"prompt_tokens"')
    if i < 0:
        return None, None
    prompt = _int_after(body, i + 15)
    j = body.rfind(b'"cached_tokens"')
    return prompt, (_int_after(body, j + 15) if j >= 0 else None)
