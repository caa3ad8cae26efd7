"""YAML `health_checks` and `outlier_detection`: the health state machines' configuration (proxy/core/health.py).

A module of its own: the config loader reads a section's dataclass fields, defaults and bounds off the class
at run time, which a class compiled by mypyc (proxy/native compiles health.py) does not offer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Literal

from proxy.core.bounds import above, at_least, check_config

__all__ = ["HealthCheckConfig", "OutlierConfig"]


@dataclass(frozen=True, slots=True)
class HealthCheckConfig:
    """YAML `health_checks`. Defaults evict a hung backend in ~9 s and a refusing one at its first check."""

    enabled: bool = True
    protocol: Literal["http", "grpc"] = "http"  # grpc: grpc.health.v1 Check on the backend's gRPC address
    path: str = "/health"  # http: GET this path, 2xx is healthy
    grpc_service: str = ""  # grpc.health.v1 service name; "" asks about the whole server
    interval_ms: int = above(2000, 0)
    jitter: float = field(default=0.1, metadata={"ge": 0, "lt": 1})  # interval * [1 - jitter, 1 + jitter]
    timeout_ms: int = above(1000, 0)  # floor of the timeout; the adaptive timeout only ever raises it
    healthy_threshold: int = at_least(2, 1)
    unhealthy_threshold: int = at_least(3, 1)
    adaptive_timeout: bool = True
    adaptive_k: float = at_least(4.0, 1)  # timeout >= k x p99 of this backend's recent check latencies
    adaptive_max_timeout_ms: int = above(10000, 0)
    latency_window: int = at_least(64, 1)  # recent check latencies kept per backend for the p99
    # TLS checks (proxy/control/checks.py): the handshake gets its own budget, >= this x the p95 of the
    # backend's recent handshakes (the whole adaptive_max_timeout_ms before there is one), apart from the above.
    handshake_k: float = at_least(2.5, 1)
    fail_fast_on_refused: bool = True  # a refused/reset connection marks the backend unhealthy at once

    def __post_init__(self) -> None:
        check_config(self)

    def validate(self) -> Iterable[tuple[str, str]]:
        if not self.path.startswith("/"):
            yield "path", f"must start with '/', got {self.path!r}"
        if self.adaptive_max_timeout_ms < self.timeout_ms:
            yield "adaptive_max_timeout_ms", f"must be >= timeout_ms ({self.timeout_ms})"


@dataclass(frozen=True, slots=True)
class OutlierConfig:
    """YAML `outlier_detection`: passive ejection from what the data plane sees."""

    enabled: bool = True
    consecutive_5xx: int = at_least(5, 1)
    consecutive_connect_failures: int = at_least(3, 1)
    consecutive_stream_failures: int = at_least(3, 1)  # streams that broke after the response started
    base_ejection_ms: int = above(5000, 0)  # first ejection; the n-th lasts n x base (capped)
    max_ejection_ms: int = above(300000, 0)
    # Never more than this share of the fleet ejected at once (one backend always may be).
    max_ejection_percent: float = field(default=50.0, metadata={"ge": 0, "le": 100})
    decay_ms: int = above(30000, 0)  # the repeat multiplier drops by one per decay_ms without a new ejection
    return_on_check: bool = True  # an expired ejection ends at the next passing active check (if checks run)

    def __post_init__(self) -> None:
        check_config(self)

    def validate(self) -> Iterable[tuple[str, str]]:
        if self.max_ejection_ms < self.base_ejection_ms:
            yield "max_ejection_ms", f"must be >= base_ejection_ms ({self.base_ejection_ms})"
