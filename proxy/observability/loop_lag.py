"""How late each process's event loop runs what it was asked to run: the proxy's own stalls.

Everything a process does for its requests runs on one event loop: parsing, the pick, relaying streams, and
noting each answer's end (which frees the request's slot in the load the next picks read). A callback that
holds the loop (a prompt tokenised inline, a burst of KV events decoded, a garbage collection) delays all of
them. The replay measured what that costs at ~96% busy: when the proxy learns of each answer's end 10 ms
late, its placements cost ~30 ms of TTFT mean more (loadtest/results/scaleout-live.md, Round 18). This
module makes the stalls visible: every `interval_s` a timer asks to be woken, and how much later than asked
it ran goes into `affinity_proxy_event_loop_lag_seconds` (per process; with `--workers` the supervisor's
/metrics adds every process's samples up).
"""

from __future__ import annotations

import asyncio
import time
from typing import Iterable

from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric

from proxy.metrics import BucketCounts

__all__ = ["LAG_BUCKETS", "LoopLag"]

# Upper bounds in seconds. uvloop wakes timers on whole milliseconds, so a lag under 1 ms is the timer's
# own rounding, not a stall.
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class LoopLag:
    def __init__(self, interval_s: float = 0.1) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self.interval_s = interval_s
        self.hist = BucketCounts(LAG_BUCKETS)
        self.max_s = 0.0

    def observe(self, lag_s: float) -> None:
        lag_s = max(0.0, lag_s)
        self.hist.observe(lag_s)
        if lag_s > self.max_s:
            self.max_s = lag_s

    async def run(self) -> None:
        """Until cancelled: sleep `interval_s`, observe how much longer the sleep took."""
        interval = self.interval_s
        clock = time.perf_counter
        while True:
            t0 = clock()
            await asyncio.sleep(interval)
            self.observe(clock() - t0 - interval)

    def collect(self) -> Iterable[Metric]:
        hist = HistogramMetricFamily(
            "affinity_proxy_event_loop_lag_seconds",
            "How much later than asked the event loop ran a timer (sampled every 100 ms): the time a callback "
            "held the loop, during which no request was parsed, picked or relayed and no answer's end noted.")
        hist.add_metric([], self.hist.cumulative(), self.hist.total)
        worst = GaugeMetricFamily("affinity_proxy_event_loop_lag_max_seconds",
                                  "The longest event-loop lag sampled since the process started.")
        worst.add_metric([], self.max_s)
        return [hist, worst]
