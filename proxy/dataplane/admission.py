"""Admission when every backend is saturated: answer at once (429/503 + Retry-After) or wait briefly.

`Router.pick` decides saturation (in-flight limits, engine queue and KV thresholds, total limit) and raises
`Overloaded`. With `overload.action: queue` the lease waits here instead: a bounded FIFO of waiters, each
woken when capacity may have appeared (a request finished, or a new snapshot was published) and given at
most `queue_timeout_ms` in total. A full queue or an expired wait still gets the explicit overload answer:
a request is never dropped silently and never waits unboundedly.

Wake-ups are one waiter per finished request (FIFO, no thundering herd) and all waiters per snapshot,
since a snapshot can free capacity on many backends at once (a backend recovered, a weight changed).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Callable, TypeVar

from proxy.control.resilience_metrics import ResilienceMetrics
from proxy.core.overload import OverloadConfig

T = TypeVar("T")


class AdmissionQueue:
    def __init__(self, cfg: OverloadConfig, metrics: ResilienceMetrics | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics if metrics is not None else ResilienceMetrics()
        # Requests waiting for capacity; Lease.finish reads it to skip `notify_one` when none waits.
        self.waiters: deque[asyncio.Future[None]] = deque()
        self.admitted_after_wait = 0
        self.timed_out = 0

    @property
    def enabled(self) -> bool:
        return self.cfg.action == "queue"

    def __len__(self) -> int:
        return len(self.waiters)

    def notify_one(self) -> None:
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return

    def notify_all(self) -> None:
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(None)

    async def wait_for(self, attempt: Callable[[], T], first: Exception) -> T:
        """Call `attempt` whenever capacity may have freed up, until it stops raising `first`'s type.

        Re-raises `first` (the overload answer) when the queue is full or the bounded wait is over.
        """
        if len(self.waiters) >= self.cfg.queue_size:
            self.metrics.shed.labels("queue_full").inc()
            raise first
        overloaded = type(first)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.queue_timeout_ms / 1000.0
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                self.timed_out += 1
                self.metrics.shed.labels("queue_timeout").inc()
                raise first
            fut: asyncio.Future[None] = loop.create_future()
            self.waiters.append(fut)
            try:
                await asyncio.wait_for(fut, remaining)
            except asyncio.TimeoutError:
                pass
            finally:
                try:
                    self.waiters.remove(fut)
                except ValueError:
                    pass
            try:
                result = attempt()
            except overloaded as exc:
                first = exc
                continue
            self.admitted_after_wait += 1
            return result


__all__ = ["AdmissionQueue"]
