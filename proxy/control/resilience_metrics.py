"""Prometheus counters of the resilience machinery: checks, ejections, retries, shedding, reloads, drains.

Created on the proxy's own registry (ProxyMetrics.registry) when one is given, else on a private one, so
control-plane objects built in tests need no metrics plumbing. Label sets are small and fixed: a metric
label per backend is bounded by the fleet size, the rest are enums.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class ResilienceMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry if registry is not None else CollectorRegistry()
        self.registry = r
        self.checks = Counter(
            "affinity_proxy_health_checks", "Active health checks, by backend and result.", ["backend", "result"],
            registry=r,
        )
        self.transitions = Counter(
            "affinity_proxy_health_transitions", "Changes of a backend's health, by new state and cause.",
            ["backend", "health", "cause"], registry=r,
        )
        self.ejections = Counter(
            "affinity_proxy_outlier_ejections", "Passive outlier ejections, by backend.", ["backend"], registry=r
        )
        self.retries = Counter(
            "affinity_proxy_retries", "Attempts retried on another backend, by cause.", ["cause"], registry=r
        )
        self.retries_denied = Counter(
            "affinity_proxy_retries_denied", "Retryable failures not retried, by why (budget, attempts, no_backend).",
            ["why"], registry=r,
        )
        self.shed = Counter(
            "affinity_proxy_overload_shed", "Requests answered early because every backend was saturated, by how.",
            ["how"], registry=r,
        )
        self.reloads = Counter(
            "affinity_proxy_config_reloads", "Configuration reloads, by result (ok, invalid).", ["result"], registry=r
        )
        self.reload_ok = Gauge(
            "affinity_proxy_config_last_reload_ok",
            "1 when the last reload attempt succeeded (or none was made), 0 while the file on disk is invalid.",
            registry=r,
        )
        self.reload_ok.set(1)
        self.drained = Counter(
            "affinity_proxy_backends_drained", "Removed backends that finished draining, by how (idle, deadline).",
            ["how"], registry=r,
        )
