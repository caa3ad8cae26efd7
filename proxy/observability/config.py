"""The `logging:` section (application log format and the access log). Loading it imports nothing heavy."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Literal

from proxy.core.bounds import check_config


@dataclass(frozen=True)
class AccessLogConfig:
    """One line per finished request, written by `proxy.observability.access_log.AccessLog`.

    ```yaml
    logging:
      access_log:
        enabled: true
        path: null              # null: standard output; or a file, opened for appending
        sample_ratio: 1.0       # share of requests logged (evenly spaced, deterministic)
        max_lines_per_s: null   # per process; above it lines are dropped and counted in one summary line
        always_log_errors: true # 5xx / gRPC server errors are logged whatever the sampling and the rate limit
        flush_interval_s: 1.0   # lines are batched (a pipe-atomic 4 KiB at most) and written at least this often
    ```
    """

    enabled: bool = True
    path: str | None = None
    sample_ratio: float = field(default=1.0, metadata={"ge": 0, "le": 1})
    max_lines_per_s: int | None = field(default=None, metadata={"ge": 1})
    always_log_errors: bool = True
    flush_interval_s: float = field(default=1.0, metadata={"ge": 0})

    def __post_init__(self) -> None:
        check_config(self)

    def validate(self) -> Iterable[tuple[str, str]]:
        if self.path is not None and not self.path.strip():
            yield "path", "must not be blank (null means standard output)"


@dataclass(frozen=True)
class LoggingConfig:
    """How the proxy logs: one format for application logs and the access log.

    ```yaml
    logging:
      format: json     # json: one JSON object per line (what Loki and other log stores ingest) | text
      access_log: {...}
    ```
    """

    format: Literal["json", "text"] = "json"
    access_log: AccessLogConfig = AccessLogConfig()

    def __post_init__(self) -> None:
        check_config(self)


@dataclass(frozen=True)
class TracingConfig:
    """OpenTelemetry traces, exported in batches over OTLP/HTTP (protobuf) off the request path.

    ```yaml
    tracing:
      enabled: false
      endpoint: http://127.0.0.1:4318/v1/traces   # the collector's OTLP/HTTP traces endpoint
      headers: {}                 # e.g. {authorization: "Bearer ..."} for the collector
      sampler: parent_based       # parent_based: follow the client's sampled flag, `ratio` for new traces
                                  # ratio: `ratio` always | always_on | always_off
      ratio: 0.1
      service_name: affinity-proxy
      max_queue: 2048             # spans waiting for export; more are dropped, never waited for
      batch_delay_ms: 1000
      export_timeout_s: 10
    ```
    """

    enabled: bool = False
    endpoint: str = "http://127.0.0.1:4318/v1/traces"
    headers: dict[str, str] = field(default_factory=dict)
    sampler: Literal["parent_based", "ratio", "always_on", "always_off"] = "parent_based"
    ratio: float = field(default=0.1, metadata={"ge": 0, "le": 1})
    service_name: str = field(default="affinity-proxy", metadata={"min_len": 1})
    max_queue: int = field(default=2048, metadata={"ge": 1})
    batch_delay_ms: int = field(default=1000, metadata={"ge": 1})
    export_timeout_s: float = field(default=10.0, metadata={"gt": 0})

    def __post_init__(self) -> None:
        check_config(self)

    def validate(self) -> Iterable[tuple[str, str]]:
        if not self.endpoint.startswith(("http://", "https://")):
            yield "endpoint", f"must be an http:// or https:// URL, got {self.endpoint!r}"
