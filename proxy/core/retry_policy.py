"""Retries: which failed attempts may be retried, the retry budget and the backoff (pure, no clock).

Retries happen only before any byte reached the client, and on another backend (proxy/dataplane/retry.py
drives them). The budget bounds retries to a share of requests, so retries cannot turn an overload into a
retry storm. Time (`now`, seconds, any monotonic origin) and randomness (`u`) are passed in by the caller.
"""

from __future__ import annotations

import math
from collections import deque

from proxy.core.decision import Outcome
from proxy.core.retry_config import RETRY_CONDITIONS, RetryConfig

__all__ = ["RETRY_CONDITIONS", "RetryBudget", "RetryConfig", "backoff_s", "retryable"]

class RetryBudget:
    """Retries allowed over a sliding window: budget_percent of requests plus a per-second floor.

    Bucketed (10 buckets per window) so memory is constant whatever the request rate.
    """

    BUCKETS = 10

    def __init__(self, cfg: RetryConfig) -> None:
        self.cfg = cfg
        self._width = cfg.budget_window_ms / 1000.0 / self.BUCKETS
        self._buckets: deque[list[int]] = deque()  # [bucket index, requests, retries]
        self._requests = 0
        self._retries = 0

    def _advance(self, now: float) -> list[int]:
        idx = math.floor(now / self._width)
        while self._buckets and self._buckets[0][0] <= idx - self.BUCKETS:
            _, req, ret = self._buckets.popleft()
            self._requests -= req
            self._retries -= ret
        if not self._buckets or self._buckets[-1][0] != idx:
            self._buckets.append([idx, 0, 0])
        return self._buckets[-1]

    def on_request(self, now: float) -> None:
        buckets = self._buckets
        if buckets and buckets[-1][0] == math.floor(now / self._width):
            # Still the newest bucket: whatever expired was dropped when it was opened (`_advance`).
            buckets[-1][1] += 1
            self._requests += 1
            return
        bucket = self._advance(now)
        bucket[1] += 1
        self._requests += 1

    def allowed(self, now: float) -> int:
        self._advance(now)
        window_s = self.cfg.budget_window_ms / 1000.0
        return math.floor(self._requests * self.cfg.budget_percent / 100.0 + self.cfg.min_retries_per_s * window_s)

    def try_acquire(self, now: float) -> bool:
        """Take one retry from the budget if there is room."""
        if self._retries >= self.allowed(now):
            return False
        bucket = self._advance(now)
        bucket[2] += 1
        self._retries += 1
        return True

    @property
    def requests(self) -> int:
        return self._requests

    @property
    def retries(self) -> int:
        return self._retries


def retryable(cfg: RetryConfig, outcome: Outcome, status: int | None = None) -> bool:
    """May this failed attempt be retried? Only failures where nothing can have reached the client.

    A STREAM_FAILURE is never retryable: part of the answer is already with the client, and a second
    answer spliced after it would duplicate or corrupt it.
    """
    if not cfg.enabled:
        return False
    if outcome is Outcome.CONNECT_FAILURE:
        return "connect-failure" in cfg.retry_on
    if outcome is Outcome.RESET:
        return "reset" in cfg.retry_on
    if status is not None and outcome in (Outcome.STATUS_5XX, Outcome.SUCCESS):
        return status in cfg.retry_statuses
    return False


def backoff_s(cfg: RetryConfig, retry: int, u: float) -> float:
    """Full-jitter exponential backoff before retry number `retry` (1-based); `u` is uniform in [0, 1)."""
    cap = min(cfg.backoff_max_ms, cfg.backoff_base_ms * 2.0 ** (retry - 1))
    return cap * u / 1000.0
