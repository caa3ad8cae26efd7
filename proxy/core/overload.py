"""Overload and panic: when a backend takes no new request, and when the health signal is distrusted.

Pure functions of the snapshot and the data plane's in-flight counts (proxy/dataplane/admission.py
queues or rejects on their answer). Panic: when too few backends are routable, the health signal itself
is probably wrong (or all are degraded); routing to all of them serves more than routing to the few
survivors.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Collection, Iterable, Literal, Mapping

from proxy.core.bounds import above, at_least, check_config
from proxy.core.decision import Inflight
from proxy.core.snapshot import BackendState, Health, Snapshot

__all__ = ["OverloadConfig", "PanicView", "backend_limit", "in_panic", "saturated", "saturated_names"]


@dataclass(frozen=True, slots=True)
class OverloadConfig:
    """YAML `overload`: when every routable backend is saturated, answer early or queue briefly."""

    max_inflight_per_backend: int | None = at_least(None, 1)  # default for backends without their own max_inflight
    max_waiting: float | None = at_least(None, 0)  # engine queue (waiting requests) above this = saturated
    max_kv_usage: float | None = field(default=None, metadata={"gt": 0, "le": 1})  # KV usage above = saturated
    action: Literal["reject", "queue"] = "reject"  # reject at once | wait for capacity up to queue_timeout_ms
    reject_status: int = 503  # 503 (server saturated) or 429 (client should slow down); both carry Retry-After
    retry_after_s: int = at_least(1, 0)
    queue_size: int = at_least(256, 1)
    queue_timeout_ms: int = above(2000, 0)
    # Below this share of routable backends (not draining) the health signal is distrusted: route to all.
    panic_threshold_percent: float = field(default=50.0, metadata={"ge": 0, "le": 100})

    def __post_init__(self) -> None:
        check_config(self)

    def validate(self) -> Iterable[tuple[str, str]]:
        if self.reject_status not in (429, 503):
            yield "reject_status", f"must be 429 or 503, got {self.reject_status}"


def backend_limit(state: BackendState, cfg: OverloadConfig) -> int | None:
    return state.spec.max_inflight if state.spec.max_inflight is not None else cfg.max_inflight_per_backend


def saturated(state: BackendState, inflight: Inflight | None, cfg: OverloadConfig) -> bool:
    """A backend that should get no new request now: at its in-flight limit, or (fresh) telemetry says
    its engine queue or KV cache is past the configured threshold. Stale signals are ignored: a backend
    whose metrics broke is judged by the proxy's own in-flight count only.
    """
    limit = backend_limit(state, cfg)
    if limit is not None and inflight is not None and inflight.requests >= limit:
        return True
    sig = state.signals
    if sig is None or state.stale:
        return False
    if cfg.max_waiting is not None and sig.waiting is not None and sig.waiting > cfg.max_waiting:
        return True
    if cfg.max_kv_usage is not None and sig.kv_usage is not None and sig.kv_usage > cfg.max_kv_usage:
        return True
    return False


def may_saturate(snapshot: Snapshot, cfg: OverloadConfig) -> frozenset[str]:
    """The backends of `snapshot` that `saturated` can call saturated under `cfg`, whatever their in-flight
    counts: those with an in-flight limit, and those whose fresh telemetry a queue or KV threshold reads.
    For every other backend `saturated` is False (the data plane skips asking it)."""
    thresholds = cfg.max_waiting is not None or cfg.max_kv_usage is not None
    return frozenset(
        b.name for b in snapshot.backends
        if backend_limit(b, cfg) is not None or (thresholds and b.signals is not None and not b.stale)
    )


def saturated_names(snapshot: Snapshot, inflight: Mapping[str, Inflight], cfg: OverloadConfig) -> frozenset[str]:
    return frozenset(b.name for b in snapshot.backends if b.routable and saturated(b, inflight.get(b.name), cfg))


def in_panic(snapshot: Snapshot, threshold_percent: float, joining: Collection[str] = ()) -> bool:
    """Too few routable backends among those serving (not draining, weight > 0, not still joining)?

    Backends still waiting for their first passing check (`joining`) are not part of the serving fleet
    yet: adding several at once must neither trigger panic nor be routed to by it.
    """
    candidates = [b for b in snapshot.backends
                  if b.health is not Health.DRAINING and b.effective_weight > 0 and b.name not in joining]
    if not candidates or threshold_percent <= 0:
        return False
    routable = sum(1 for b in candidates if b.health.routable)
    return routable * 100.0 < threshold_percent * len(candidates)


class PanicView:
    """Swaps in a view where UNHEALTHY backends count as UNKNOWN while the fleet is in panic.

    The view is computed once per published snapshot (one-entry cache on the snapshot object), so the
    data plane pays a pointer comparison per request, not a scan of the fleet. `joining` names the backends
    still waiting for their first passing check; they stay unroutable even in panic. It is asked when a
    new snapshot arrives, which is also when that set changes (a joiner's first pass publishes one).
    """

    __slots__ = ("threshold_percent", "joining", "_source", "_view", "panicking")

    def __init__(self, threshold_percent: float, joining: Callable[[], Collection[str]] | None = None) -> None:
        self.threshold_percent = threshold_percent
        self.joining = joining
        self._source: Snapshot | None = None
        self._view: Snapshot | None = None
        self.panicking = False

    def __call__(self, snapshot: Snapshot) -> Snapshot:
        if snapshot is self._source and self._view is not None:
            return self._view
        joining = self.joining() if self.joining is not None else ()
        self.panicking = in_panic(snapshot, self.threshold_percent, joining)
        if self.panicking:
            view = Snapshot(
                version=snapshot.version,
                backends=tuple(
                    replace(b, health=Health.UNKNOWN) if b.health is Health.UNHEALTHY and b.name not in joining else b
                    for b in snapshot.backends
                ),
            )
        else:
            view = snapshot
        self._source, self._view = snapshot, view
        return view
