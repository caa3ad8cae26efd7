"""One finished request, as the access log, the heat-map windows and (later) the trace see it.

The request lifecycle (proxy/dataplane) fills one `RequestRecord` in its finish step, for every protocol,
and hands it to `Observer.on_finish`. It is a plain mutable `msgspec.Struct` so the lifecycle can create it
at admission and fill fields as they become known (decision, attempts, first byte, usage) without building
a dict per request. Every field is always written to the access log, null when unknown, so a log store sees
one stable schema. A Struct rather than a slots dataclass: made and JSON-encoded in C, it costs about half
as much per request (construction ~1.0 -> ~0.4 us, access-log encode ~1.0 -> ~0.5 us here), with the
same fields in the same order and byte-identical log lines.
"""

from __future__ import annotations

import msgspec

# Protocol names as they appear in the access log.
HTTP1 = "http/1.1"
H2 = "h2"
GRPC = "grpc"
PROTOCOLS = (HTTP1, H2, GRPC)

# gRPC codes that mean the server side failed (counted as errors like a 5xx): UNKNOWN, DEADLINE_EXCEEDED,
# RESOURCE_EXHAUSTED, INTERNAL, UNAVAILABLE, DATA_LOSS. Client mistakes (INVALID_ARGUMENT, NOT_FOUND, ...)
# are not the backend's fault, exactly as a 4xx is not.
GRPC_SERVER_ERRORS = frozenset({2, 4, 8, 13, 14, 15})


class RequestRecord(msgspec.Struct, kw_only=True):
    """Everything the access log needs about one request. Field order is the log line's key order."""

    # Wall-clock seconds (Unix epoch) when the request finished; None: `Observer.on_finish` stamps it with
    # its clock. Epoch seconds, not a formatted string, because formatting costs µs on the hot path and
    # Loki/promtail parse it directly (`timestamp: {source: time, format: Unix}`).
    time: float | None = None
    # Wall-clock seconds when it was routed: set by `Observer.on_pick`, None when that hook is not used.
    started: float | None = None
    request_id: str
    trace_id: str | None = None  # 32 hex digits of the W3C trace, when there is one
    client: str | None = None  # peer address "ip:port"
    protocol: str = HTTP1  # http/1.1 | h2 | grpc
    method: str = "POST"  # HTTP method (gRPC: POST, as on the wire)
    path: str = ""  # HTTP path, or the gRPC method "/package.Service/Method" (its :path)
    model: str | None = None
    adapter: str | None = None
    session: str | None = None
    policy: str | None = None
    reason: str | None = None  # proxy.core.decision.Reason value of the final pick
    backend: str | None = None  # None when no backend was chosen (rejected, bad request, nothing routable)
    attempts: int = 0  # upstream attempts made (1 + retries)
    status: int = 0  # HTTP status sent to the client (gRPC: the HTTP/2 :status, normally 200)
    grpc_status: int | None = None  # gRPC status code of the call, None for plain HTTP
    error: str | None = None  # the proxy's own error kind when it failed the request itself
    ttft_s: float | None = None  # first response byte (first token when streaming) after arrival
    duration_s: float = 0.0  # arrival to last byte sent
    prompt_tokens: int | None = None  # as the backend reported them (usage), never the proxy's estimate
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when reported
    bytes_in: int = 0  # request body bytes
    bytes_out: int = 0  # response body bytes
    # The chosen backend's load score and this process's in-flight requests to it at pick time: what the
    # heat map shows per window. None when unknown.
    load_score: float | None = None
    inflight: int | None = None
    # With KV events (`telemetry.kv_events`): the backend whose engine held the most of the prompt at the
    # final pick, and how many tokens (proxy.core.decision.Decision.kv_holder/kv_cached). None without them.
    kv_holder: str | None = None
    kv_cached: int | None = None

    @property
    def failed(self) -> bool:
        """A server-side failure: what the error-rate rule counts (5xx, or a gRPC server error code)."""
        if self.status >= 500:
            return True
        return self.grpc_status is not None and self.grpc_status in GRPC_SERVER_ERRORS
