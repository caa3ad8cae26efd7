"""The data-plane-neutral routing step: summary -> pick -> in-flight accounting -> metrics.

Both data planes (HTTP here, gRPC in proxy/grpc/) do exactly this around each upstream exchange:

    async with router.route(summary) as lease:      # raises UnknownModel / NoBackendAvailable / Overloaded
        backend = lease.backend                     # BackendState chosen against one snapshot
        ...forward to backend.spec.url...
        lease.status = 200                          # what the client got; recorded when the block exits

`route()` picks at `__aenter__` (so a retry after a failure is just another `route(summary,
exclude=lease.tried)`), counts the request in the shared `InflightTable` for exactly as long as the block runs
(streams included, client disconnects included: cancellation exits the block too), and records the decision,
status and duration. Overload and retry policy (RESILIENCE) plug in here so every protocol gets them.
"""

from __future__ import annotations

import time
from types import TracebackType
from typing import TYPE_CHECKING, Callable

from proxy.control.store import SnapshotStore
from proxy.core.decision import Decision, NoBackendAvailable, Outcome, Policy
from proxy.core.overload import OverloadConfig, PanicView, saturated
from proxy.core.request import RequestSummary
from proxy.core.snapshot import BackendState, Snapshot
from proxy.core.inflight import InflightTable
from proxy.metrics import ProxyMetrics

if TYPE_CHECKING:
    from proxy.dataplane.admission import AdmissionQueue


class UnknownModel(NoBackendAvailable):
    """No configured backend serves the requested model: a client error (404), not an outage."""


class Overloaded(NoBackendAvailable):
    """Every candidate is saturated (in-flight limit, engine queue or KV usage over `overload` thresholds),
    or the process is at `limits.max_inflight_total`. Answered with `status` and `Retry-After`."""

    def __init__(self, message: str, status: int = 503, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s


class _ModelIndex:
    """Per snapshot version: which backends cannot serve a model (to exclude) and which models exist."""

    __slots__ = ("version", "any_model", "known", "exclude")

    def __init__(self, snapshot: Snapshot) -> None:
        self.version = snapshot.version
        self.any_model = any(not b.spec.models for b in snapshot.backends)
        self.known = frozenset(m for b in snapshot.backends for m in b.spec.models)
        self.exclude: dict[str, frozenset[str]] = {}

    def excluded_for(self, snapshot: Snapshot, model: str) -> frozenset[str]:
        ex = self.exclude.get(model)
        if ex is None:
            ex = self.exclude[model] = frozenset(
                b.name for b in snapshot.backends if b.spec.models and model not in b.spec.models
            )
        return ex


class Lease:
    """One routed request for the duration of its upstream exchange."""

    __slots__ = ("router", "summary", "exclude", "decision", "backend", "status", "outcome", "_tokens", "_started")

    def __init__(self, router: Router, summary: RequestSummary, exclude: frozenset[str]) -> None:
        self.router = router
        self.summary = summary
        self.exclude = exclude
        self.decision: Decision
        self.backend: BackendState
        # HTTP status the client got (gRPC: mapped to the HTTP equivalent); 499 = client went away.
        self.status = 499
        # What went wrong with the backend, when the status alone cannot tell (connect failure, reset,
        # mid-stream break); None = judge by `status`. Feeds passive outlier detection.
        self.outcome: Outcome | None = None
        self._tokens = summary.prompt_tokens_est + (summary.max_tokens or 0)

    @property
    def tried(self) -> frozenset[str]:
        """Backends to exclude when retrying this request elsewhere."""
        return self.exclude | {self.decision.backend}

    async def __aenter__(self) -> Lease:
        router = self.router
        try:
            self.decision, self.backend = router.pick(self.summary, self.exclude)
        except Overloaded as exc:
            if router.queue is None or not router.queue.enabled:
                raise
            self.decision, self.backend = await router.queue.wait_for(
                lambda: router.pick(self.summary, self.exclude), exc
            )
        self.router.inflight.acquire(self.decision.backend, self._tokens)
        self._started = time.perf_counter()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        name = self.decision.backend
        router = self.router
        router.inflight.release(name, self._tokens)
        router.metrics.finished(name, self.status, time.perf_counter() - self._started)
        if router.queue is not None:
            router.queue.notify_one()
        report = router.on_outcome
        if report is not None:
            outcome = self.outcome
            if outcome is None and self.status != 499:  # 499: the client left, says nothing of the backend
                outcome = Outcome.STATUS_5XX if self.status >= 500 else Outcome.SUCCESS
            if outcome is not None:
                report(name, outcome)


class Router:
    def __init__(
        self,
        store: SnapshotStore,
        policy: Policy,
        inflight: InflightTable,
        metrics: ProxyMetrics,
        max_inflight_total: int | None = None,
    ) -> None:
        self.store = store
        self.policy = policy
        self.inflight = inflight
        self.metrics = metrics
        self.max_inflight_total = max_inflight_total
        self._models = _ModelIndex(store.current)
        # RESILIENCE hooks (proxy/resilience.py): saturation thresholds, panic routing, the overload queue
        # and the passive outlier reports. Defaults keep the plain behaviour (spec.max_inflight only).
        self.overload = OverloadConfig()
        self.panic: PanicView | None = None
        self.queue: AdmissionQueue | None = None
        self.on_outcome: Callable[[str, Outcome], None] | None = None

    def route(self, summary: RequestSummary, exclude: frozenset[str] = frozenset()) -> Lease:
        return Lease(self, summary, exclude)

    def model_known(self, model: str | None, snapshot: Snapshot | None = None) -> bool:
        snapshot = snapshot or self.store.current
        index = self._index(snapshot)
        return model is None or index.any_model or model in index.known or not snapshot.backends

    def _index(self, snapshot: Snapshot) -> _ModelIndex:
        index = self._models
        if index.version != snapshot.version:
            index = self._models = _ModelIndex(snapshot)
        return index

    def pick(self, summary: RequestSummary, exclude: frozenset[str]) -> tuple[Decision, BackendState]:
        """Choose a backend for `summary` against the current snapshot, honouring in-flight limits."""
        if self.max_inflight_total is not None and self.inflight.total_requests >= self.max_inflight_total:
            self.metrics.error("overloaded")
            raise self._overloaded(f"the proxy is at its limit of {self.max_inflight_total} requests in flight")
        snapshot = self.store.current
        if self.panic is not None:
            snapshot = self.panic(snapshot)  # too few healthy: the unhealthy ones count as routable again
        model = summary.model
        if model is not None:
            index = self._index(snapshot)
            if not index.any_model:
                if model not in index.known and snapshot.backends:
                    self.metrics.error("unknown_model")
                    raise UnknownModel(f"The model '{model}' does not exist")
                excluded = index.excluded_for(snapshot, model)
                if excluded:
                    exclude = exclude | excluded
        limited = False
        for _ in range(len(snapshot.backends) + 1):
            try:
                decision = self.policy.pick(summary, snapshot, self.inflight, exclude)
            except NoBackendAvailable as exc:
                if limited:
                    break
                self.metrics.error("no_backend")
                raise NoBackendAvailable(str(exc) or "no backend is available") from None
            backend = snapshot.get(decision.backend)
            if backend is None:
                raise RuntimeError(f"policy {self.policy.name} picked {decision.backend!r}, not in the snapshot")
            if not saturated(backend, self.inflight.get(backend.name), self.overload):
                self.metrics.decision(decision.policy, decision.reason)
                return decision, backend
            exclude = exclude | {backend.name}
            limited = True
        self.metrics.error("overloaded")
        raise self._overloaded("every backend that serves this request is saturated")

    def _overloaded(self, message: str) -> Overloaded:
        return Overloaded(message, self.overload.reject_status, self.overload.retry_after_s)
