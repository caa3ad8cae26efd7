"""Safe retries for every data plane: another backend, only while the client has received nothing.

The data plane (OpenAIPipeline.handle for HTTP/1.1 and the HTTP/2 bridge; proxy/grpc/call.py for gRPC)
keeps one `Attempts` per request. An attempt that fails before a single byte went
to the client raises `RetryableFailure` carrying the answer the client would get if no retry happens (the
proxy's own 502, or the backend's 429/503 read in full but not forwarded). The loop then asks the
`RetryController` whether this failure kind is retryable, whether attempts are left and whether the retry
budget allows one more, waits a jittered backoff, and routes again excluding every backend tried so far
(`Lease.tried`), so the policy's next choice is its alternate. Once a response has started streaming the
attempt never raises `RetryableFailure`: a mid-stream failure ends the client's stream with an error
event, because splicing a second answer after a partial first one would duplicate or corrupt it.

Every attempt counts in the shared in-flight table and reports its outcome for outlier detection through
its own lease, so a retried request is accounted to each backend it touched.
"""

from __future__ import annotations

import random
import time
from typing import Any, Callable, Generic, TypeVar

from proxy.control.resilience_metrics import ResilienceMetrics
from proxy.core.decision import Outcome
from proxy.core.retry_policy import RetryBudget, RetryConfig, backoff_s, retryable

T = TypeVar("T")


class RetryableFailure(Exception, Generic[T]):
    """An attempt failed before anything reached the client; `response` is what to send if not retried."""

    def __init__(self, outcome: Outcome, response: T, status: int | None = None) -> None:
        super().__init__(f"{outcome.value} {status or ''}".strip())
        self.outcome = outcome
        self.response = response
        self.status = status


class RetryController:
    """Config, budget and backoff randomness of one process (the budget is shared by all protocols)."""

    def __init__(
        self,
        cfg: RetryConfig,
        *,
        metrics: ResilienceMetrics | None = None,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.budget = RetryBudget(cfg)
        self.metrics = metrics if metrics is not None else ResilienceMetrics()
        self.rng = rng if rng is not None else random.Random()
        self.clock = clock
        self.retried = 0
        # The statuses whose answers are held back for a retry (none when retries are off or one attempt
        # is all there is): one set lookup per answer (`retry_status`).
        self.held_statuses = _held_statuses(cfg)

    def reconfigure(self, cfg: RetryConfig) -> None:
        if cfg != self.cfg:
            self.cfg = cfg
            self.budget = RetryBudget(cfg)
            self.held_statuses = _held_statuses(cfg)

    def retry_status(self, status: int) -> bool:
        """Should an upstream answer with this status be held back (read, not forwarded) for a retry?"""
        return status in self.held_statuses

    def on_request(self) -> None:
        self.budget.on_request(self.clock())

    def allow(self, failure: RetryableFailure[object], attempts_done: int) -> bool:
        if not retryable(self.cfg, failure.outcome, failure.status):
            return False
        if attempts_done >= self.cfg.max_attempts:
            self.metrics.retries_denied.labels("attempts").inc()
            return False
        if not self.budget.try_acquire(self.clock()):
            self.metrics.retries_denied.labels("budget").inc()
            return False
        return True

    def backoff(self, retry_number: int) -> float:
        return backoff_s(self.cfg, retry_number, self.rng.random())


def _held_statuses(cfg: RetryConfig) -> frozenset[int]:
    return cfg.retry_statuses if cfg.enabled and cfg.max_attempts > 1 else frozenset()


class Attempts:
    """The retry bookkeeping of one request: attempts made, backends to exclude, the shared budget.

    The OpenAI pipeline's loop (proxy/dataplane/openai.py `handle`) drives it for HTTP/1.1 and the HTTP/2
    bridge; gRPC's callback-driven calls (proxy/grpc/call.py) drive the same object step by step, so both
    follow one policy.
    """

    __slots__ = ("controller", "count", "exclude")

    def __init__(self, controller: RetryController | None) -> None:
        self.controller = controller
        self.count = 1  # attempts started so far
        self.exclude: frozenset[str] = frozenset()
        if controller is not None:
            controller.on_request()  # counts toward the shared retry budget

    def retry(self, failure: RetryableFailure[Any], tried: frozenset[str]) -> float | None:
        """After attempt `count` failed before the first byte on the backends `tried`: the backoff (s)
        before the next attempt, or None when the policy, the attempts left or the budget say no."""
        controller = self.controller
        if controller is None or not controller.allow(failure, self.count):
            return None
        self.count += 1
        self.exclude = tried
        controller.retried += 1
        label = failure.outcome.value if failure.status is None else str(failure.status)
        controller.metrics.retries.labels(label).inc()
        return controller.backoff(self.count - 1)

    def no_backend_left(self) -> None:
        """A retry found no other backend: the client gets the failure it would have got."""
        if self.controller is not None:
            self.controller.metrics.retries_denied.labels("no_backend").inc()


__all__ = ["Attempts", "RetryController", "RetryableFailure"]
