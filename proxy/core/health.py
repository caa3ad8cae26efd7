"""Health checks and outlier ejection: pure state machines (events in, state out), and their configs.

Everything here is driven by plain values: a check result with its latency, a request outcome, and the
time `now` (seconds, any monotonic origin) passed in by the caller. Nothing reads a clock or draws a
random number, so every transition can be tested by feeding events, and the control plane's asyncio tasks
(proxy/control/checks.py) and the data plane stay thin adapters around these objects.

Why the pieces look the way they do:
- Hysteresis (`healthy_threshold` / `unhealthy_threshold`): one slow answer must not evict a backend and
  one lucky answer must not re-admit a broken one.
- Timeouts and refusals are different evidence. A refused or reset connection proves nothing is serving
  (counts at once, `fail_fast_on_refused`); a timeout may be a GC pause or a long prefill stalling the
  event loop. So the adaptive timeout is at least k x the p99 of the backend's own check latency, and it
  doubles with each consecutive timeout (capped): a paused backend gets a probe patient enough to see
  it answer again before `unhealthy_threshold` timeouts pile up, while a hung one is still evicted after
  a bounded time (timeout x (2^threshold - 1) plus the intervals: 7 s + 2 intervals with the defaults).
- Passive outlier detection sees what active checks miss (a /health that passes while completions fail).
  Ejections grow with repeats and are capped to a share of the fleet, so a fleet-wide problem (a bad
  deploy, an overloaded cluster) never ejects everyone. An ejection ends with a passing health check once
  its time is up, not blindly, so a backend that still fails is not handed traffic again on a timer.

Retries and their budget live in proxy/core/retry_policy.py, overload and panic in proxy/core/overload.py.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable

from proxy.core.decision import Outcome
from proxy.core.health_config import HealthCheckConfig, OutlierConfig
from proxy.core.snapshot import Health

# --------------------------------------------------------------------------------------------- config
# Frozen dataclasses with defaults, parsed from YAML by proxy/config.py and checked by proxy/core/bounds.py
# (simple bounds in the field metadata, cross-field rules in `validate()`), whether parsed or built in code.


# ------------------------------------------------------------------------------------- active checks


class CheckResult(str, enum.Enum):
    PASS = "pass"
    FAIL = "fail"  # answered, but not healthy (non-2xx, NOT_SERVING)
    TIMEOUT = "timeout"  # no answer within the (adaptive) timeout: maybe a pause, maybe dead
    REFUSED = "refused"  # connection refused or reset: certainly not serving


def nearest_rank_percentile(values: Iterable[float], q: float) -> float:
    """Nearest-rank percentile; small windows (tens of values) make sorting the cheapest correct way."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


class ActiveHealth:
    """One backend's active-check state: consecutive counters with hysteresis and its latency window.

    `joining` backends (added by reload or discovery while serving) start unroutable and become healthy at
    their first passing check: traffic must not reach an address nobody has seen answer yet. Backends
    known at start-up start UNKNOWN (routable) instead, because a fresh proxy must serve before its first
    check completes.
    """

    __slots__ = ("cfg", "state", "successes", "failures", "timeouts", "latencies_ms", "checked", "joining")

    def __init__(self, cfg: HealthCheckConfig, joining: bool = False) -> None:
        self.cfg = cfg
        self.state = Health.UNHEALTHY if joining else Health.UNKNOWN
        self.successes = 0
        self.failures = 0
        self.timeouts = 0  # consecutive timeouts: each one doubles the next adaptive timeout
        self.latencies_ms: deque[float] = deque(maxlen=cfg.latency_window)
        self.checked = False
        self.joining = joining  # until the first passing check

    def timeout_ms(self) -> float:
        """The timeout for the next check: max(floor, k x p99 of recent latencies) x 2^consecutive timeouts,
        capped at adaptive_max_timeout_ms; just the floor when the adaptive timeout is off."""
        cfg = self.cfg
        if not cfg.adaptive_timeout:
            return float(cfg.timeout_ms)
        base = float(cfg.timeout_ms)
        if self.latencies_ms:
            base = max(base, cfg.adaptive_k * nearest_rank_percentile(self.latencies_ms, 99))
        return float(min(cfg.adaptive_max_timeout_ms, base * (2 ** min(self.timeouts, 30))))

    def observe(self, result: CheckResult, latency_ms: float | None = None) -> Health:
        """Feed one check result; returns the (possibly new) active state."""
        cfg = self.cfg
        first = not self.checked
        self.checked = True
        if result is CheckResult.PASS:
            if latency_ms is not None:
                self.latencies_ms.append(max(0.0, latency_ms))
            self.failures = 0
            self.timeouts = 0
            self.successes += 1
            # The very first answer of a backend decides at once: there is no earlier evidence to outweigh.
            joined = self.joining  # a joiner joins at its first pass, whatever failed before it
            self.joining = False
            if first or joined or self.successes >= cfg.healthy_threshold:
                self.state = Health.HEALTHY
            return self.state
        self.successes = 0
        self.failures += 1
        self.timeouts = self.timeouts + 1 if result is CheckResult.TIMEOUT else 0
        hard = result is CheckResult.REFUSED and cfg.fail_fast_on_refused
        if hard or self.failures >= cfg.unhealthy_threshold:
            self.state = Health.UNHEALTHY
        return self.state


# ------------------------------------------------------------------------------------ passive outliers


class OutlierState:
    """One backend's passive counters and its ejection (if any)."""

    __slots__ = ("cfg", "c5xx", "cconnect", "cstream", "ejected_until", "ejections", "last_ejection_at", "expired")

    def __init__(self, cfg: OutlierConfig) -> None:
        self.cfg = cfg
        self.c5xx = 0
        self.cconnect = 0
        self.cstream = 0
        self.ejected_until: float | None = None  # set while ejected
        self.ejections = 0  # the repeat multiplier
        self.last_ejection_at: float | None = None
        self.expired = False  # ejection time is up, waiting for a passing check to return

    @property
    def ejected(self) -> bool:
        return self.ejected_until is not None

    def record(self, outcome: Outcome) -> bool:
        """Count an outcome; True when a threshold is reached (the fleet decides whether to eject)."""
        cfg = self.cfg
        if outcome is Outcome.SUCCESS:
            self.c5xx = self.cconnect = self.cstream = 0
            return False
        if outcome is Outcome.STATUS_5XX:
            self.c5xx += 1
            return self.c5xx >= cfg.consecutive_5xx
        if outcome in (Outcome.CONNECT_FAILURE, Outcome.RESET):
            self.cconnect += 1
            return self.cconnect >= cfg.consecutive_connect_failures
        self.cstream += 1
        return self.cstream >= cfg.consecutive_stream_failures

    def eject(self, now: float) -> float:
        """Start an ejection; returns its duration in seconds."""
        cfg = self.cfg
        if self.last_ejection_at is not None:
            decayed = int((now - self.last_ejection_at) * 1000 // cfg.decay_ms)
            self.ejections = max(0, self.ejections - decayed)
        self.ejections += 1
        duration_ms = min(cfg.max_ejection_ms, cfg.base_ejection_ms * self.ejections)
        self.ejected_until = now + duration_ms / 1000.0
        self.last_ejection_at = now
        self.expired = False
        self.c5xx = self.cconnect = self.cstream = 0
        return duration_ms / 1000.0

    def release(self) -> None:
        self.ejected_until = None
        self.expired = False


# --------------------------------------------------------------------------------------------- fleet


@dataclass(frozen=True, slots=True)
class HealthChange:
    name: str
    health: Health
    cause: str  # check_pass, check_fail, check_timeout, check_refused, ejected, ejection_expired, ...


class FleetHealth:
    """Health of every backend: active state and ejections combined into the snapshot's `Health`.

    Combined health: UNHEALTHY if the active checks say so or the backend is ejected; otherwise HEALTHY
    or UNKNOWN from the active checks. DRAINING is not decided here (reload, discovery and the admin API
    set it on the snapshot); callers must not overwrite it with what this returns.
    """

    def __init__(self, checks: HealthCheckConfig, outliers: OutlierConfig) -> None:
        self.checks = checks
        self.outliers = outliers
        self._active: dict[str, ActiveHealth] = {}
        self._outlier: dict[str, OutlierState] = {}

    # --- membership
    def add(self, name: str, joining: bool = False) -> Health:
        """Track a backend. With active checks off a joiner is routable at once: nothing would admit it."""
        self._active[name] = ActiveHealth(self.checks, joining=joining and self.checks.enabled)
        self._outlier[name] = OutlierState(self.outliers)
        return self.health(name)

    def remove(self, name: str) -> None:
        self._active.pop(name, None)
        self._outlier.pop(name, None)

    def __contains__(self, name: object) -> bool:
        return name in self._active

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._active)

    def reconfigure(self, checks: HealthCheckConfig, outliers: OutlierConfig) -> None:
        """Apply new configs on reload, keeping each backend's counters, latencies and ejections."""
        self.checks = checks
        self.outliers = outliers
        for name, act in self._active.items():
            act.cfg = checks
            if act.latencies_ms.maxlen != checks.latency_window:
                act.latencies_ms = deque(act.latencies_ms, maxlen=checks.latency_window)
            self._outlier[name].cfg = outliers

    # --- queries
    def health(self, name: str) -> Health:
        if self._outlier[name].ejected:
            return Health.UNHEALTHY
        return self._active[name].state

    def timeout_s(self, name: str) -> float:
        return self._active[name].timeout_ms() / 1000.0

    def ejected(self, name: str) -> bool:
        return self._outlier[name].ejected

    def joining(self) -> frozenset[str]:
        """Backends added while serving that have not passed a check yet (unroutable, even in panic)."""
        return frozenset(n for n, a in self._active.items() if a.joining)

    def describe(self, now: float) -> dict[str, dict[str, Any]]:
        """Plain-data view of every backend's machines, for the admin API."""
        out: dict[str, dict[str, Any]] = {}
        for name, act in self._active.items():
            o = self._outlier[name]
            out[name] = {
                "health": self.health(name).value,
                "active": act.state.value,
                "joining": act.joining,
                "consecutive_passes": act.successes,
                "consecutive_failures": act.failures,
                "consecutive_timeouts": act.timeouts,
                "next_timeout_ms": round(act.timeout_ms(), 1),
                "check_p99_ms": round(nearest_rank_percentile(act.latencies_ms, 99), 2) if act.latencies_ms else None,
                "ejected": o.ejected,
                "ejected_for_s": None if o.ejected_until is None else round(max(0.0, o.ejected_until - now), 3),
                "ejections": o.ejections,
                "consecutive_5xx": o.c5xx,
                "consecutive_connect_failures": o.cconnect,
                "consecutive_stream_failures": o.cstream,
            }
        return out

    def ejected_count(self) -> int:
        return sum(1 for o in self._outlier.values() if o.ejected)

    def check_latencies_ms(self, name: str) -> tuple[float, ...]:
        return tuple(self._active[name].latencies_ms)

    # --- events
    def on_check(self, name: str, result: CheckResult, latency_ms: float | None, now: float) -> HealthChange | None:
        """An active check finished. Returns the change of combined health, if any."""
        if name not in self._active:
            return None  # removed while its check was in flight
        before = self.health(name)
        self._active[name].observe(result, latency_ms)
        out = self._outlier[name]
        if result is CheckResult.PASS and out.ejected and self.outliers.return_on_check:
            if out.expired or (out.ejected_until is not None and now >= out.ejected_until):
                out.release()
        return self._change(name, before, f"check_{result.value}")

    def on_success(self, name: str) -> None:
        """`on_outcome(name, Outcome.SUCCESS, now)`, which never changes health: the failure streaks of
        `name` end (the data plane's usual report, without a clock read)."""
        if self.outliers.enabled:
            out = self._outlier.get(name)
            if out is not None:
                out.record(Outcome.SUCCESS)  # the streaks' one rule; a success never reaches a threshold

    def on_outcome(self, name: str, outcome: Outcome, now: float) -> HealthChange | None:
        """The data plane finished an attempt on `name`. Returns the change of combined health, if any."""
        if not self.outliers.enabled or name not in self._outlier:
            return None
        out = self._outlier[name]
        if not out.record(outcome) or out.ejected:
            return None
        if not self._may_eject():
            return None
        before = self.health(name)
        out.eject(now)
        return self._change(name, before, f"ejected_{outcome.value}")

    def tick(self, now: float) -> list[HealthChange]:
        """Time passes: expired ejections end (at once without active checks, else at the next pass)."""
        changes: list[HealthChange] = []
        for name, out in self._outlier.items():
            if out.ejected_until is None or now < out.ejected_until:
                continue
            if self.checks.enabled and self.outliers.return_on_check:
                out.expired = True
                continue
            before = self.health(name)
            out.release()
            change = self._change(name, before, "ejection_expired")
            if change is not None:
                changes.append(change)
        return changes

    def next_expiry(self) -> float | None:
        pending = [o.ejected_until for o in self._outlier.values() if o.ejected_until is not None and not o.expired]
        return min(pending) if pending else None

    # --- internals
    def _may_eject(self) -> bool:
        """Cap ejections to max_ejection_percent of the fleet, but always allow one (Envoy's rule)."""
        n = len(self._outlier)
        allowed = max(1, math.floor(n * self.outliers.max_ejection_percent / 100.0 + 1e-9))
        return self.ejected_count() + 1 <= allowed

    def _change(self, name: str, before: Health, cause: str) -> HealthChange | None:
        after = self.health(name)
        return None if after is before else HealthChange(name, after, cause)


__all__ = [
    "ActiveHealth",
    "CheckResult",
    "FleetHealth",
    "HealthChange",
    "HealthCheckConfig",
    "OutlierConfig",
    "OutlierState",
    "nearest_rank_percentile",
]
