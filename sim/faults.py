"""Faults a test can switch on in a simulated server, by CLI flag or at run time (POST /sim/faults).

One mutable `Faults` value per server, read by the backend (stall, failures, drops, background load) and by
the HTTP/gRPC front ends (slow or absent /metrics, failing health, refused connections). `update` takes the
JSON the control endpoint receives and rejects unknown keys and wrong types with a message naming the key,
so a typo in a test fails loudly instead of silently testing nothing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping


@dataclass(slots=True)
class Faults:
    stall_ms: float = 0.0  # write-only trigger: pause engine + every endpoint for this long, from now
    drop_after_chunks: int | None = None  # streams are cut (no clean end) after this many chunks
    fail_rate: float = 0.0  # share of generation requests answered with `fail_status` before any token
    fail_status: int = 500
    metrics_delay_ms: float = 0.0  # /metrics answers this late
    metrics_absent: bool = False  # /metrics answers 404
    health_fail: bool = False  # /health (and gRPC health) answer 503 / NOT_SERVING
    refuse_connections: bool = False  # the listeners are closed: connects are refused
    refuse_ms: float = 0.0  # write-only: with refuse_connections, reopen the listeners after this long
    background_requests: int = 0  # artificial load: this many internal requests kept running
    background_prompt_tokens: int = 512
    background_max_tokens: int = 512

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("stall_ms")
        out.pop("refuse_ms")
        return out

    def update(self, changes: Mapping[str, Any]) -> None:
        """Apply a partial update; raises ValueError naming the bad key (nothing applied then)."""
        known = {f.name: f for f in fields(self)}
        staged: dict[str, Any] = {}
        for key, value in changes.items():
            if key not in known:
                raise ValueError(f"unknown fault {key!r}; known: {', '.join(sorted(known))}")
            staged[key] = _coerce(key, value)
        for key, value in staged.items():
            setattr(self, key, value)


_INT_OR_NONE = {"drop_after_chunks"}
_INTS = {"fail_status", "background_requests", "background_prompt_tokens", "background_max_tokens"}
_FLOATS = {"stall_ms", "refuse_ms", "fail_rate", "metrics_delay_ms"}
_BOOLS = {"metrics_absent", "health_fail", "refuse_connections"}


def _coerce(key: str, value: Any) -> Any:
    if key in _BOOLS:
        if not isinstance(value, bool):
            raise ValueError(f"{key} must be a boolean")
        return value
    if key in _INT_OR_NONE and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{key} must be a number")
    if key in _INTS or key in _INT_OR_NONE:
        if int(value) != value or value < 0:
            raise ValueError(f"{key} must be a non-negative integer")
        value = int(value)
        if key == "fail_status" and not 500 <= value <= 599:
            raise ValueError("fail_status must be a 5xx status")
        if key == "background_prompt_tokens" and value < 1 or key == "background_max_tokens" and value < 1:
            raise ValueError(f"{key} must be at least 1")
        return value
    value = float(value)
    if value < 0:
        raise ValueError(f"{key} must be >= 0")
    if key == "fail_rate" and value > 1:
        raise ValueError("fail_rate must be between 0 and 1")
    return value
