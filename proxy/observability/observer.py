"""What the request lifecycle calls once per finished request: `Observer.on_finish(record)`.

Optionally also `Observer.on_pick(record)` once the backend is chosen: the Observer then keeps the record
until it finishes, and at each window's end counts the requests still waiting for their first byte
(`record.ttft_s` still None) with their age. That is how a stalled backend, which finishes nothing while it
stalls, is seen as slow during the stall rather than only once it recovers. Windows are closed by the next
request to finish or by `tick()`; `run()` ticks every second so a quiet or fully stalled proxy still
closes its windows on time.

It feeds the access log and the heat-map windows, and, when a window closes, the hot-spot rules, whose
transitions become one log line each, a Prometheus gauge per backend and state, and `/admin/hotspots`.
The hot path is a few attribute reads, one msgspec encode into a shared buffer and two histogram bumps; the
rules run once per window (every 10 s), not per request.

With ``--workers N`` each worker keeps its own windows. The supervisor can own the judging instead: workers
are built with ``role="worker"`` and hand their closed windows over with `take_closed()` (plain data), and
the supervisor's Observer (``role="aggregator"``, access log off) merges one collection round from every
worker with `ingest()` and judges the merged windows, so a backend's p99 is computed over all its requests,
not over one worker's share. A worker's window that arrives after its index was judged still shows on the
page but is not judged again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any, Callable, Iterable, Iterator, Literal, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.core.hotspots import (
    LATENCY_HOT_SPOT, STATES, HotspotConfig, HotspotDetector, HotspotEvent, Window, WindowRing,
)
from proxy.observability.access_log import AccessLog, LineSink
from proxy.observability.config import LoggingConfig
from proxy.observability.record import GRPC_SERVER_ERRORS, RequestRecord

log = logging.getLogger("proxy.hotspots")

RECENT_EVENTS = 100  # transitions kept for /admin/hotspots


class _Collector(Collector):
    def __init__(self, fn: Callable[[], Iterable[Metric]]) -> None:
        self._fn = fn

    def collect(self) -> Iterable[Metric]:
        return self._fn()


class Observer:
    def __init__(
        self,
        logging_config: LoggingConfig,
        hotspot_config: HotspotConfig,
        registry: CollectorRegistry | None,
        clock: Callable[[], float] = time.time,
        sink: LineSink | None = None,
        role: Literal["single", "worker", "aggregator"] = "single",
        on_event: Callable[[HotspotEvent], None] | None = None,
    ) -> None:
        """`clock` is wall-clock seconds (Unix epoch): window k is [k*window_s, (k+1)*window_s), the same
        windows in every worker and replica. `sink` defaults to `logging_config.access_log.path` (stdout)."""
        self.logging_config = logging_config
        self.hotspot_config = hotspot_config
        self._clock = clock
        self._window_s = hotspot_config.window_s
        self._ring = WindowRing(hotspot_config.history_windows)
        self._detector = HotspotDetector(hotspot_config)
        if role not in ("single", "worker", "aggregator"):
            raise ValueError(f"role must be single, worker or aggregator, got {role!r}")
        self.role = role
        self._on_event = on_event
        self._marks: dict[int, dict[str, str]] = {}  # window index -> backend -> mark, for the heat map
        self._judged = -1  # highest window index judged
        self._pending: dict[int, RequestRecord] = {}  # id(record) -> record, from on_pick to on_finish
        self._closed: list[Window] = []  # closed, not yet taken by take_closed() (role="worker")
        self.events: deque[HotspotEvent] = deque(maxlen=RECENT_EVENTS)
        acfg = logging_config.access_log
        self.access_log: AccessLog | None = None
        if acfg.enabled:
            if sink is None:
                sink = LineSink.open(acfg.path, acfg.flush_interval_s)
            self.access_log = AccessLog(acfg, logging_config.format, sink)
        if registry is not None:
            registry.register(_Collector(self._collect))

    # ------------------------------------------------------------------ hot path

    def on_pick(self, record: RequestRecord) -> None:
        """Optional: the backend was chosen (`record.backend` set; on a retry elsewhere, just update it).
        The lifecycle sets `record.ttft_s` at the first response byte, as it does anyway for the log."""
        if record.started is None:
            record.started = self._clock()
        self._pending[id(record)] = record

    def on_finish(self, record: RequestRecord) -> None:
        """The lifecycle's finish step calls this once per request, every protocol, success or not."""
        now = self._clock()
        if record.time is None:
            record.time = now
        if self._pending:
            self._pending.pop(id(record), None)
        access = self.access_log
        if access is not None:
            access.write(record, now)
        index = int(now // self._window_s)
        cur = self._ring.current
        if cur is None or index > cur.index:
            self._roll(index)
            cur = self._ring.current
            assert cur is not None
        # (a clock stepped backwards lands in the open window)
        backend = record.backend
        if backend is None:
            cur.unrouted += 1
            return
        reason = record.reason
        if reason is not None:
            reasons = cur.reasons
            reasons[reason] = reasons.get(reason, 0) + 1
        bw = cur.backends.get(backend)
        if bw is None:
            bw = cur.backend(backend)
        status, grpc_status = record.status, record.grpc_status
        # `record.failed`, spelled out (a property call per request)
        failed = status >= 500 or (grpc_status is not None and grpc_status in GRPC_SERVER_ERRORS)
        bw.add(record.duration_s, record.ttft_s, failed, record.load_score, record.inflight)

    # ------------------------------------------------------------------ windows and rules

    def tick(self) -> None:
        """Close windows that ended with no request finishing since (the page calls it before reading)."""
        index = int(self._clock() // self._window_s)
        cur = self._ring.current
        if cur is None or index > cur.index:
            self._roll(index)

    async def run(self, interval_s: float = 1.0) -> None:
        """Tick forever, and write out access-log lines a quiet proxy still holds (start it as a task next
        to the data plane; cancel it on shutdown)."""
        while True:
            self.tick()
            if self.access_log is not None:
                self.access_log.flush(self._clock())
            await asyncio.sleep(interval_s)

    def _roll(self, index: int) -> None:
        closed = self._ring.advance(index)
        if self._pending and closed:
            self._count_waiting(closed)
        if self.role == "single":
            for w in closed:
                self._judge_window(w)
        elif self.role == "worker":
            self._closed.extend(closed)
            del self._closed[: max(0, len(self._closed) - self.hotspot_config.history_windows)]
        # aggregator: its windows are filled and judged by ingest()

    def _count_waiting(self, closed: list[Window]) -> None:
        """Add, to each closed window, the requests that were waiting for a first byte at its end."""
        ws = self._window_s
        oldest = (closed[-1].index + 1 - self.hotspot_config.history_windows) * ws
        for key, r in list(self._pending.items()):
            started, backend = r.started, r.backend
            if started is None or backend is None:
                continue
            if started < oldest:  # a request the lifecycle never finished: forget it
                del self._pending[key]
                continue
            first_byte = None if r.ttft_s is None else started + r.ttft_s
            for w in closed:
                end = (w.index + 1) * ws
                if started < end and (first_byte is None or first_byte > end):
                    w.backend(backend).add_waiting(end - started)

    def _judge_window(self, w: Window) -> None:
        if w.index <= self._judged:
            return
        self._judged = w.index
        for event in self._detector.observe(w):
            self.events.append(event)
            self._log_event(event)
            if self._on_event is not None:
                self._on_event(event)
        marks = {}
        for name in w.backends:
            mark = self._detector.mark(name)
            if mark is not None:
                marks[name] = mark
        if marks:
            self._marks[w.index] = marks
        floor = w.index - self.hotspot_config.history_windows
        for i in [i for i in self._marks if i <= floor]:
            del self._marks[i]

    @staticmethod
    def _log_event(e: HotspotEvent) -> None:
        what = "a latency hot spot" if e.state == LATENCY_HOT_SPOT else "spreading an anomaly"
        p99 = "-" if e.p99_s is None else f"{e.p99_s:.3f}s"
        base = "-" if e.baseline_p99_s is None else f"{e.baseline_p99_s:.3f}s"
        err = "-" if e.error_rate is None else f"{100 * e.error_rate:.1f}%"
        base_err = "-" if e.baseline_error_rate is None else f"{100 * e.baseline_error_rate:.1f}%"
        message = (f"backend {e.backend} {'is' if e.entered else 'is no longer'} {what} "
                   f"(p99 {p99} vs baseline {base}, errors {err} vs {base_err})")
        log.log(logging.WARNING if e.entered else logging.INFO, message,
                extra={"event": "hotspot_enter" if e.entered else "hotspot_leave", **e.to_data()})

    def take_closed(self) -> list[dict[str, Any]]:
        """Closed windows not handed over yet, as plain data (role="worker"); empty ones are left out."""
        self.tick()
        out = [w.to_data() for w in self._closed if w.backends or w.unrouted]
        self._closed.clear()
        return out

    def ingest(self, rounds: Iterable[Iterable[Mapping[str, Any]]]) -> None:
        """Merge one collection round (every worker's `take_closed()`) and judge the windows it brought, in
        order (role="aggregator")."""
        merged: dict[int, Window] = {}
        for windows in rounds:
            for data in windows:
                w = Window.from_data(data)
                if w.index in merged:
                    merged[w.index].merge(w)
                else:
                    merged[w.index] = w
        if not merged:
            return
        self.tick()
        self._ring.merge_data(w.to_data() for w in merged.values())
        for index in sorted(merged):
            kept = self._ring.window(index)
            if kept is not None and (self._ring.current is None or index < self._ring.current.index):
                self._judge_window(kept)

    # ------------------------------------------------------------------ reads (admin endpoints)

    def flush(self) -> None:
        """Write out buffered access-log lines (shutdown, or a periodic task on a quiet proxy)."""
        if self.access_log is not None:
            self.access_log.flush(self._clock())

    def close(self) -> None:
        self.flush()

    def hotspots(self) -> dict[str, Any]:
        self.tick()
        cur = self._ring.current
        return {
            "window_s": self._window_s,
            "current_window": None if cur is None else cur.index,
            "rules": {"metric": self.hotspot_config.metric, "latency_rise": self.hotspot_config.latency_rise,
                      "error_rise": self.hotspot_config.error_rise, "windows": self.hotspot_config.windows,
                      "clear_windows": self.hotspot_config.clear_windows,
                      "baseline": f"median p99 of the backend's last {self.hotspot_config.baseline_windows} "
                                  "normal windows; pooled error rate over the same windows"},
            "backends": self._detector.status(),
            "events": [e.to_data() for e in self.events],
        }

    def heatmap(self, backends: Iterable[str] = ()) -> dict[str, Any]:
        """The last `history_windows` windows (the open one last) x every backend seen or named, with each
        metric per cell (null: no request finished there) and the rules' marks."""
        self.tick()
        cur = self._ring.current
        n = self.hotspot_config.history_windows
        last = cur.index if cur is not None else int(self._clock() // self._window_s)
        indices = list(range(last - n + 1, last + 1))
        windows = [self._ring.window(i) for i in indices]
        names = list(dict.fromkeys([*backends, *sorted({b for w in windows if w for b in w.backends})]))
        metric = self.hotspot_config.metric

        def series(fn: Callable[[Any], Any]) -> list[list[Any]]:
            rows = []
            for name in names:
                row = []
                for w in windows:
                    bw = w.backends.get(name) if w is not None else None
                    row.append(None if bw is None or (bw.requests == 0 and bw.waiting_n == 0) else fn(bw))
                rows.append(row)
            return rows

        mix: dict[str, int] = {}
        for w in windows[-7:]:  # the open window and the minute before it
            if w is not None:
                for reason, count in w.reasons.items():
                    mix[reason] = mix.get(reason, 0) + count
        return {
            "window_s": self._window_s,
            "windows": indices,
            "start": indices[0] * self._window_s,
            "open_window": last,
            "backends": names,
            "metric_rule": metric,
            "metrics": {
                "ttft_p99": series(lambda bw: bw.p99("ttft") if sum(bw.ttft) or bw.waiting_n else None),
                "e2e_p99": series(lambda bw: bw.p99("e2e")),
                "error_rate": series(lambda bw: bw.error_rate),
                "load_score": series(lambda bw: bw.load_score),
                "inflight": series(lambda bw: bw.inflight),
                "requests": series(lambda bw: bw.requests),
                "waiting": series(lambda bw: bw.waiting_n),
            },
            "marks": [[self._marks.get(i, {}).get(name) for i in indices] for name in names],
            "routing_mix": dict(sorted(mix.items(), key=lambda kv: -kv[1])),
            "states": {name: self._detector.state(name) for name in names},
        }

    # ------------------------------------------------------------------ Prometheus

    def _collect(self) -> Iterator[Metric]:
        g = GaugeMetricFamily("affinity_proxy_backend_hotspot",
                              "1 while the backend is in the state (latency_hot_spot, spreading_anomaly).",
                              labels=["backend", "state"])
        for name, state in sorted((n, self._detector.state(n)) for n in self._detector.status()):
            for s in STATES:
                g.add_metric([name, s], 1.0 if state[s] else 0.0)
        yield g
        a = self.access_log
        if a is not None:
            c = CounterMetricFamily("affinity_proxy_access_log_lines", "Access-log lines, by outcome.",
                                    labels=["outcome"])
            c.add_metric(["written"], a.written)
            c.add_metric(["sampled_out"], a.sampled_out)
            c.add_metric(["rate_limited"], a.rate_limited)
            c.add_metric(["dropped"], a.dropped)  # the output (a pipe) did not drain
            yield c
