"""The `grpc:` configuration section: how the h2c/gRPC listener extracts routing inputs and moves bytes.

The listener's address is the top-level `grpc_listen` (a `ListenConfig`); everything about behaviour is
here. Example::

    grpc:
      session_metadata: x-session-id      # metadata key used as the session / route key
      extractors:
        - method: /acme.llm.v1.Completion/Complete
          kind: fields                    # generate | kserve | fields | none
          prompt: [2]                     # field-number path into the request message
          messages: [5]                   # repeated {role=1, content=2}, used when prompt is empty
          model: [1]
          max_tokens: [3]
          temperature: [4]
          session: [7, 1]                 # nested: field 7 (a message), its field 1

The project's own Generation service and KServe v2 ModelInfer/ModelStreamInfer are built in; an entry
for the same method replaces the built-in one, and ``kind: none`` routes a method without waiting for
its first message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Literal

ExtractorKind = Literal["generate", "kserve", "fields", "none"]


@dataclass(frozen=True)
class MethodExtractorConfig:
    """Which extractor routes one gRPC method (``/package.Service/Method``)."""

    method: str = field(metadata={"min_len": 1})
    kind: ExtractorKind = "fields"
    # Field-number paths for kind=fields; an empty path means "not present in this message".
    prompt: tuple[int, ...] = ()
    messages: tuple[int, ...] = ()
    model: tuple[int, ...] = ()
    max_tokens: tuple[int, ...] = ()
    temperature: tuple[int, ...] = ()
    session: tuple[int, ...] = ()
    # A metadata key whose value becomes the route key for this method (overrides `session_metadata`).
    route_key_metadata: str | None = None

    def validate(self) -> Iterable[tuple[str, str]]:
        if not (self.method.startswith("/") and self.method.count("/") == 2):
            yield "method", f"must look like /package.Service/Method, got {self.method!r}"
        for name in ("prompt", "messages", "model", "max_tokens", "temperature", "session"):
            path = getattr(self, name)
            if any(n < 1 or n > 536_870_911 for n in path):
                yield name, "field numbers must be between 1 and 536870911"
            if path and self.kind != "fields":
                yield name, f"field paths only apply to kind: fields (this entry is kind: {self.kind})"
        if self.kind == "fields" and not (self.prompt or self.messages or self.session or self.model):
            yield "prompt", "a fields extractor needs at least one of prompt, messages, session or model"


@dataclass(frozen=True)
class GrpcOptions:
    extractors: tuple[MethodExtractorConfig, ...] = ()
    # Metadata key read as the session / route key when the message carries none (lower-case).
    session_metadata: str | None = "x-session-id"
    # Largest first message held to route on; a larger one is routed without its prompt.
    max_routing_message_bytes: int = field(default=4 * 1024 * 1024, metadata={"ge": 1024})
    # A call whose first message does not come within this time is routed without it (a bidi client that
    # waits for the server to speak first must not hang).
    first_message_timeout_s: float = field(default=1.0, metadata={"gt": 0})
    # Advertised to clients; the proxy opens more upstream connections rather than queue behind a peer's.
    max_concurrent_streams: int = field(default=1024, metadata={"ge": 1})
    # HTTP/2 flow-control windows the proxy advertises (both sides). The proxy acknowledges data only as
    # the other side takes it, so these bound what one stream / one connection can make it buffer.
    stream_window_bytes: int = field(default=1024 * 1024, metadata={"ge": 65535, "le": 2**31 - 1})
    connection_window_bytes: int = field(default=8 * 1024 * 1024, metadata={"ge": 65535, "le": 2**31 - 1})
    max_connections_per_backend: int = field(default=16, metadata={"ge": 1})
    # Backend connections carrying calls that have heard nothing from the backend for this long get a PING;
    # one that does not answer (no frame at all) within `upstream_ping_timeout_s` is dropped and its calls
    # end UNAVAILABLE (or go to another backend when nothing was answered yet). 0 = no PINGs. The default
    # matches gRPC servers' default minimum PING interval (5 min), which they enforce by GOAWAY
    # (too_many_pings) when it is undercut; set it lower only for backends configured to allow it.
    upstream_ping_interval_s: float = field(default=300.0, metadata={"ge": 0})
    upstream_ping_timeout_s: float = field(default=20.0, metadata={"gt": 0})
    # A backend connection without calls for this long is closed (GOAWAY); 0 = kept until the backend
    # closes it.
    upstream_idle_timeout_s: float = field(default=60.0, metadata={"ge": 0})
    # Client timeouts (slow or idle clients must not hold connections forever): a connection that has not
    # sent its whole HTTP/2 preface (the magic and its SETTINGS) this long after connecting is closed; one
    # without streams that has sent nothing for `client_idle_timeout_s` gets GOAWAY and is closed (0 =
    # never); a stream whose request is not finished, that has no response yet and on which the client sent
    # nothing for `client_stream_idle_timeout_s` ends (gRPC CANCELLED with a message; RST_STREAM CANCEL for
    # a plain HTTP/2 request) (0 = never).
    client_preface_timeout_s: float = field(default=10.0, metadata={"gt": 0})
    client_idle_timeout_s: float = field(default=300.0, metadata={"ge": 0})
    client_stream_idle_timeout_s: float = field(default=300.0, metadata={"ge": 0})
    # Serve the ProxyAdmin service on this listener (writes need the admin token when one is set).
    admin_service: bool = True
    # Retry a call once on another backend when its upstream connection fails before any response byte.
    retry_on_connect_failure: bool = True
    # Request bytes kept for that retry; a call that sent more before its first response is not retried.
    replay_buffer_bytes: int = field(default=256 * 1024, metadata={"ge": 0})

    def validate(self) -> Iterable[tuple[str, str]]:
        seen: set[str] = set()
        for entry in self.extractors:
            if entry.method in seen:
                yield "extractors", f"method {entry.method!r} is configured twice"
            seen.add(entry.method)
        if self.session_metadata is not None and self.session_metadata != self.session_metadata.lower():
            yield "session_metadata", "metadata keys are lower-case"
