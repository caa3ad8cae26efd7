"""Prometheus metrics of one proxy process, in their own registry.

A registry per `ProxyMetrics` (not prometheus_client's global one) lets tests and the in-process demo run
several proxies side by side. Hot-path counters keep their label children cached, because `.labels()` costs
more than the increment itself. Values that already live somewhere (in-flight counts, the snapshot,
connection counters) are read at scrape time by a collector instead of being mirrored on every request.

Other modules add their metrics as attributes created on `self.registry` (e.g. the telemetry poller's
scrape durations), or register a collector with `register_collector`.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Awaitable, Callable, Iterable

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.control.store import SnapshotStore
from proxy.core.decision import Reason
from proxy.core.inflight import InflightTable

# Latency buckets span a cached short completion (tens of ms) to a long generation (minutes).
_DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class _FnCollector(Collector):
    def __init__(self, fn: Callable[[], Iterable[Metric]]) -> None:
        self._fn = fn

    def collect(self) -> Iterable[Metric]:
        return self._fn()


class BucketCounts:
    """A histogram as per-bucket counts over `bounds` (upper bounds, seconds; the last bucket is +Inf),
    cumulated only when scraped."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...] = _DURATION_BUCKETS) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def cumulative(self) -> list[tuple[str, float]]:
        return cumulative_buckets(self.bounds, self.counts)


def cumulative_buckets(bounds: tuple[float, ...], counts: list[int]) -> list[tuple[str, float]]:
    """A histogram's (le, count) samples from per-bucket counts (`counts[-1]`: above the last bound)."""
    out: list[tuple[str, float]] = []
    running = 0
    for bound, n in zip((*(repr(float(b)) for b in bounds), "+Inf"), counts, strict=True):
        running += n
        out.append((bound, running))
    return out


class UpstreamCounters:
    """Plain integers bumped by the upstream pool; the reuse ratio is derived from them at scrape time."""

    __slots__ = ("requests", "new_connections")

    def __init__(self) -> None:
        self.requests = 0
        self.new_connections = 0

    @property
    def reuse_ratio(self) -> float:
        if self.requests == 0:
            return 0.0
        return max(0.0, 1.0 - self.new_connections / self.requests)


class ProxyMetrics:
    def __init__(
        self, registry: CollectorRegistry | None = None,
        render: Callable[[CollectorRegistry], Awaitable[bytes]] | None = None,
    ) -> None:
        """`render`: what the admin /metrics endpoint serves, given this registry; default: this registry's
        own exposition. The --workers supervisor passes an exposition merged from every worker process
        (collected asynchronously over their channels)."""
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        # Hot-path counts are plain ints in dicts, turned into metric families at scrape time: a
        # prometheus_client child costs a lock and a method call per increment, several µs per request.
        self._requests: dict[tuple[str, int], int] = {}
        self._decisions: dict[tuple[str, Reason], int] = {}
        self._errors: dict[str, int] = {}
        self._durations: dict[str, BucketCounts] = {}
        self._first_bytes: dict[str, BucketCounts] = {}
        self.upstream = UpstreamCounters()
        r.register(_FnCollector(self._collect_requests))
        r.register(_FnCollector(self._collect_upstream))
        # process_cpu_seconds_total, resident memory, open fds: the proxy's own cost on the dashboard. With
        # --workers N every process reports its own and the supervisor's merge adds them up.
        ProcessCollector(registry=r)
        self._render_with = render

    async def render(self) -> bytes:
        if self._render_with is not None:
            return await self._render_with(self.registry)
        return await self._render_own()

    def register_collector(self, fn: Callable[[], Iterable[Metric]]) -> None:
        """Add metrics computed at scrape time from state owned elsewhere."""
        self.registry.register(_FnCollector(fn))

    def watch(self, store: SnapshotStore, inflight: InflightTable) -> None:
        def collect() -> Iterable[Metric]:
            snap = store.current
            version = GaugeMetricFamily("affinity_proxy_snapshot_version", "Version of the routing snapshot in use.")
            version.add_metric([], snap.version)
            yield version
            g = GaugeMetricFamily("affinity_proxy_inflight_requests", "Requests in flight, by backend.", labels=["backend"])
            for b in snap.backends:
                g.add_metric([b.name], inflight.requests(b.name))
            yield g
            h = GaugeMetricFamily(
                "affinity_proxy_backend_routable", "1 if the backend may receive new requests.", labels=["backend"]
            )
            for b in snap.backends:
                h.add_metric([b.name], 1.0 if b.routable else 0.0)
            yield h

        self.register_collector(collect)

    def _collect_upstream(self) -> Iterable[Metric]:
        u = self.upstream
        req = GaugeMetricFamily("affinity_proxy_upstream_requests", "Upstream requests sent (counter).")
        req.add_metric([], u.requests)
        new = GaugeMetricFamily("affinity_proxy_upstream_connections_opened", "Upstream connections opened (counter).")
        new.add_metric([], u.new_connections)
        ratio = GaugeMetricFamily(
            "affinity_proxy_upstream_connection_reuse_ratio",
            "Share of upstream requests that reused a pooled keep-alive connection.",
        )
        ratio.add_metric([], u.reuse_ratio)
        return (req, new, ratio)

    def _collect_requests(self) -> Iterable[Metric]:
        req = CounterMetricFamily(
            "affinity_proxy_requests", "Requests proxied, by backend and HTTP status.", labels=["backend", "status"]
        )
        for (backend, status), n in list(self._requests.items()):
            req.add_metric([backend, str(status)], n)
        dec = CounterMetricFamily(
            "affinity_proxy_routing_decisions", "Routing decisions, by policy and reason.", labels=["policy", "reason"]
        )
        for (policy, reason), n in list(self._decisions.items()):
            dec.add_metric([policy, reason.value], n)
        err = CounterMetricFamily(
            "affinity_proxy_errors", "Requests the proxy answered with an error itself, by kind.", labels=["kind"]
        )
        for kind, n in list(self._errors.items()):
            err.add_metric([kind], n)
        dur = HistogramMetricFamily(
            "affinity_proxy_request_duration_seconds",
            "Time from the request's head arriving to the end of the response (streams included), by backend; "
            "the same for HTTP/1.1, HTTP/2 and gRPC.",
            labels=["backend"],
        )
        for backend, hist in list(self._durations.items()):
            dur.add_metric([backend], hist.cumulative(), hist.total)
        ttfb = HistogramMetricFamily(
            "affinity_proxy_time_to_first_byte_seconds",
            "Time from the request's head arriving to the backend's first response byte (the answer's head; "
            "gRPC: its response HEADERS), by backend: TTFT as the proxy sees it, for the dashboard's heatmap.",
            labels=["backend"],
        )
        for backend, hist in list(self._first_bytes.items()):
            ttfb.add_metric([backend], hist.cumulative(), hist.total)
        return (req, dec, err, dur, ttfb)

    # Hot path: one dict update per count.
    def decision(self, policy: str, reason: Reason) -> None:
        key = (policy, reason)
        d = self._decisions
        d[key] = d.get(key, 0) + 1

    def finished(self, backend: str, status: int, seconds: float) -> None:
        key = (backend, status)
        r = self._requests
        r[key] = r.get(key, 0) + 1
        hist = self._durations.get(backend)
        if hist is None:
            hist = self._durations[backend] = BucketCounts()
        hist.counts[bisect_left(_DURATION_BUCKETS, seconds)] += 1  # hist.observe(seconds), inlined (its bounds)
        hist.total += seconds

    def first_byte(self, backend: str, seconds: float) -> None:
        hist = self._first_bytes.get(backend)
        if hist is None:
            hist = self._first_bytes[backend] = BucketCounts()
        hist.counts[bisect_left(_DURATION_BUCKETS, seconds)] += 1  # hist.observe(seconds), inlined (its bounds)
        hist.total += seconds

    def error(self, kind: str) -> None:
        e = self._errors
        e[kind] = e.get(kind, 0) + 1

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    async def _render_own(self) -> bytes:
        return self.exposition()
