"""The telemetry part of the proxy's own Prometheus metrics.

Scrape durations and errors are recorded as they happen; everything the snapshot already holds (load
score, weight, health, metrics age, staleness, the signals themselves) is read from the store at scrape
time by a collector, so the poller's 5 Hz rounds never touch a gauge.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from proxy.control.store import SnapshotStore
from proxy.core.snapshot import Health

# Scrapes of a healthy engine on a LAN take 1-5 ms; the top buckets catch ones that hit the timeout.
_SCRAPE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.5, 1.0)
_SIGNALS = ("running", "waiting", "kernel_queue", "kv_usage", "kv_tokens_per_s", "kv_capacity_tokens",
            "mem_used_bytes", "mem_total_bytes", "latency_ms", "qps", "gpu_utilization")


class TelemetryMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.scrape_duration = Histogram(
            "affinity_proxy_telemetry_scrape_duration_seconds",
            "Time to fetch one backend's metrics page (successful scrapes).",
            buckets=_SCRAPE_BUCKETS,
            registry=registry,
        )
        self.round_duration = Histogram(
            "affinity_proxy_telemetry_round_duration_seconds",
            "Time of one telemetry round over all backends (bounded by the scrape timeout).",
            buckets=_SCRAPE_BUCKETS,
            registry=registry,
        )
        self.scrape_errors = Counter(
            "affinity_proxy_telemetry_scrape_errors",
            "Failed metric scrapes, by backend and kind (timeout, connect, http_4xx, http_5xx, http, no_signals, "
            "invalid).",
            ["backend", "kind"],
            registry=registry,
        )
        self.orca_reports = Counter(
            "affinity_proxy_telemetry_orca_reports",
            "endpoint-load-metrics response headers folded into the backends' signals.",
            registry=registry,
        )
        self._error_children: dict[tuple[str, str], Counter] = {}

    def scrape_error(self, backend: str, kind: str) -> None:
        key = (backend, kind)
        child = self._error_children.get(key)
        if child is None:
            child = self._error_children[key] = self.scrape_errors.labels(backend, kind)
        child.inc()

    def snapshot_collector(self, store: SnapshotStore, clock: Callable[[], float]) -> Callable[[], Iterable[Metric]]:
        """Per-backend gauges read from the current snapshot when Prometheus scrapes the proxy."""

        def collect() -> Iterable[Metric]:
            snap = store.current
            now = clock()
            score = GaugeMetricFamily(
                "affinity_proxy_backend_load_score",
                "Load score 0 (idle) .. 1 (full) from telemetry; absent while unknown or stale.",
                labels=["backend"],
            )
            weight = GaugeMetricFamily("affinity_proxy_backend_weight", "Effective routing weight.", labels=["backend"])
            health = GaugeMetricFamily(
                "affinity_proxy_backend_health", "1 for the backend's current health state.", labels=["backend", "state"]
            )
            age = GaugeMetricFamily(
                "affinity_proxy_backend_metrics_age_seconds",
                "Seconds since the backend's last successful metrics scrape; absent if never scraped.",
                labels=["backend"],
            )
            stale = GaugeMetricFamily(
                "affinity_proxy_backend_metrics_stale",
                "1 if the backend's metrics are older than the staleness limit (routing uses in-flight counts).",
                labels=["backend"],
            )
            signal = GaugeMetricFamily(
                "affinity_proxy_backend_signal",
                "Last telemetry value per backend and signal (engine series normalised); absent if not reported.",
                labels=["backend", "signal"],
            )
            for b in snap.backends:
                if b.load_score is not None:
                    score.add_metric([b.name], b.load_score)
                weight.add_metric([b.name], b.effective_weight)
                for state in Health:
                    health.add_metric([b.name, state.value], 1.0 if b.health is state else 0.0)
                stale.add_metric([b.name], 1.0 if b.stale else 0.0)
                s = b.signals
                if s is None:
                    continue
                age.add_metric([b.name], max(0.0, now - s.scraped_at))
                for name in _SIGNALS:
                    value = getattr(s, name)
                    if value is not None and math.isfinite(value):
                        signal.add_metric([b.name, name], float(value))
            return (score, weight, health, age, stale, signal)

        return collect
