"""YAML `retries`: the retry policy's configuration (proxy/core/retry_policy.py applies it).

A module of its own: the config loader reads a section's dataclass fields, defaults and bounds off the class
at run time, which a class compiled by mypyc (proxy/native compiles retry_policy.py) does not offer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from proxy.core.bounds import above, at_least, check_config

__all__ = ["RETRY_CONDITIONS", "RetryConfig"]

RETRY_CONDITIONS = ("connect-failure", "reset")


@dataclass(frozen=True, slots=True)
class RetryConfig:
    """YAML `retries`. Retries happen only before any byte reached the client, and on another backend."""

    enabled: bool = True
    max_attempts: int = at_least(3, 1)  # including the first
    # connect-failure: the backend could not be reached; reset: connection lost before a response status;
    # a number: that upstream status (its body is discarded, never forwarded, when a retry happens).
    retry_on: tuple[str, ...] = ("connect-failure", "reset", "429", "503")
    backoff_base_ms: int = at_least(20, 0)
    backoff_max_ms: int = at_least(200, 0)
    budget_percent: float = at_least(20.0, 0)  # retries <= this share of requests over the window ...
    min_retries_per_s: float = at_least(5.0, 0)  # ... plus this floor, so a quiet proxy can still retry
    budget_window_ms: int = above(10000, 0)

    def __post_init__(self) -> None:
        check_config(self)

    def validate(self) -> Iterable[tuple[str, str]]:
        for i, cond in enumerate(self.retry_on):
            if not (cond in RETRY_CONDITIONS or (cond.isdigit() and 400 <= int(cond) <= 599)):
                yield "retry_on", (f"item {i} ({cond!r}) must be one of {', '.join(RETRY_CONDITIONS)} "
                                   "or a 4xx/5xx status")
        if self.backoff_max_ms < self.backoff_base_ms:
            yield "backoff_max_ms", f"must be >= backoff_base_ms ({self.backoff_base_ms})"

    @property
    def retry_statuses(self) -> frozenset[int]:
        return frozenset(int(c) for c in self.retry_on if c.isdigit())
