"""The pure health, outlier, retry-budget, overload and panic machines, fed plain events and times."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.config import DiscoveryConfig
from proxy.core.bounds import ConfigValueError, config_errors
from proxy.core.decision import Inflight, Outcome
from proxy.core.health import ActiveHealth, CheckResult, FleetHealth, HealthCheckConfig, OutlierConfig
from proxy.core.health import nearest_rank_percentile
from proxy.core.overload import OverloadConfig, PanicView, in_panic, may_saturate, saturated, saturated_names
from proxy.core.retry_policy import RetryBudget, RetryConfig, backoff_s, retryable
from proxy.core.snapshot import BackendSpec, BackendState, Health, Signals, Snapshot

P, F, T, R = CheckResult.PASS, CheckResult.FAIL, CheckResult.TIMEOUT, CheckResult.REFUSED


def fleet(n: int = 4, checks: HealthCheckConfig | None = None, outliers: OutlierConfig | None = None) -> FleetHealth:
    fh = FleetHealth(checks or HealthCheckConfig(), outliers or OutlierConfig())
    for i in range(n):
        fh.add(f"b{i}")
    return fh


# ------------------------------------------------------------------------------------------ config


@pytest.mark.parametrize(
    "section, yaml_text, message",
    [
        ("health_checks", "protocol: tcp", "protocol (line 1): must be one of 'http', 'grpc'"),
        ("health_checks", "path: health", "path (line 1): must start with '/'"),
        ("health_checks", "jitter: 1.0", "jitter (line 1): must be < 1"),
        ("health_checks", "interval_ms: 10\nunhealthy_threshold: 0", "unhealthy_threshold (line 2): must be >= 1"),
        ("health_checks", "timeout_ms: 2000\nadaptive_max_timeout_ms: 1000", "adaptive_max_timeout_ms (line 2)"),
        ("outlier_detection", "consecutive_5xx: 0", "consecutive_5xx (line 1): must be >= 1"),
        ("outlier_detection", "max_ejection_percent: 101", "max_ejection_percent (line 1): must be <= 100"),
        ("retries", "retry_on: [connect-failure, teapot]", "retry_on (line 1): item 1 ('teapot')"),
        ("retries", "retry_on: ['200']", "retry_on (line 1): item 0"),
        ("retries", "max_attempts: 0", "max_attempts (line 1): must be >= 1"),
        ("overload", "action: drop", "action (line 1): must be one of 'reject', 'queue'"),
        ("overload", "reject_status: 500", "reject_status (line 1)"),
        ("overload", "max_kv_usage: 1.5", "max_kv_usage (line 1): must be <= 1"),
        ("discovery", "interval_ms: 0", "interval_ms (line 1): must be > 0"),
    ],
)
def test_invalid_yaml_sections_name_key_and_line(section: str, yaml_text: str, message: str) -> None:
    from proxy.config import ConfigError, parse_section

    cls = {"health_checks": HealthCheckConfig, "outlier_detection": OutlierConfig, "retries": RetryConfig,
           "overload": OverloadConfig, "discovery": DiscoveryConfig}[section]
    with pytest.raises(ConfigError) as info:
        parse_section(cls, yaml_text)
    assert any(message in e for e in info.value.errors), info.value.errors


def test_yaml_sections_parse_with_defaults() -> None:
    from proxy.config import parse_section

    hc = parse_section(HealthCheckConfig, "protocol: grpc\ninterval_ms: 50\n")
    assert hc == HealthCheckConfig(protocol="grpc", interval_ms=50)
    rc = parse_section(RetryConfig, "retry_on: [reset, '502']")
    assert rc.retry_statuses == {502} and rc.retry_on == ("reset", "502")
    oc = parse_section(OverloadConfig, "action: queue\nreject_status: 503\nmax_kv_usage: 0.9")
    assert (oc.action, oc.reject_status, oc.max_kv_usage) == ("queue", 503, 0.9)


def test_code_built_configs_check_themselves() -> None:
    assert config_errors(HealthCheckConfig()) == []
    with pytest.raises(ConfigValueError) as info:
        HealthCheckConfig(interval_ms=0, path="x")
    assert info.value.errors == [("interval_ms", "must be > 0, got 0"), ("path", "must start with '/', got 'x'")]
    with pytest.raises(ConfigValueError) as info:
        OutlierConfig(max_ejection_ms=1, base_ejection_ms=2)
    assert info.value.errors == [("max_ejection_ms", "must be >= base_ejection_ms (2)")]
    assert config_errors(OverloadConfig(max_kv_usage=0.5)) == []


def test_defaults_are_valid() -> None:
    for cls in (HealthCheckConfig, OutlierConfig, RetryConfig, OverloadConfig, DiscoveryConfig):
        assert config_errors(cls()) == []
    assert RetryConfig().retry_statuses == frozenset({429, 503})


# ------------------------------------------------------------------------------------- active checks


def test_hysteresis_needs_consecutive_failures_and_successes() -> None:
    a = ActiveHealth(HealthCheckConfig(healthy_threshold=2, unhealthy_threshold=3))
    assert a.state is Health.UNKNOWN
    assert a.observe(P, 5) is Health.HEALTHY  # first answer decides at once
    assert a.observe(T) is Health.HEALTHY
    assert a.observe(F) is Health.HEALTHY
    assert a.observe(P, 5) is Health.HEALTHY  # a pass resets the failure count
    assert a.observe(T) is Health.HEALTHY
    assert a.observe(T) is Health.HEALTHY
    assert a.observe(T) is Health.UNHEALTHY
    assert a.observe(P, 5) is Health.UNHEALTHY  # one lucky answer does not re-admit
    assert a.observe(F) is Health.UNHEALTHY
    assert a.observe(P, 5) is Health.UNHEALTHY
    assert a.observe(P, 5) is Health.HEALTHY


def test_refused_counts_at_once_timeout_does_not() -> None:
    cfg = HealthCheckConfig(unhealthy_threshold=3)
    a = ActiveHealth(cfg)
    a.observe(P, 1)
    assert a.observe(R) is Health.UNHEALTHY
    b = ActiveHealth(HealthCheckConfig(unhealthy_threshold=3, fail_fast_on_refused=False))
    b.observe(P, 1)
    assert b.observe(R) is Health.HEALTHY
    assert b.observe(R) is Health.HEALTHY
    assert b.observe(R) is Health.UNHEALTHY


def test_joining_backend_is_unroutable_until_first_pass() -> None:
    a = ActiveHealth(HealthCheckConfig(healthy_threshold=3), joining=True)
    assert not a.state.routable
    assert a.observe(F) is Health.UNHEALTHY and a.joining
    assert a.observe(P, 1) is Health.HEALTHY and not a.joining  # joins at its first pass, even after a failure
    assert a.observe(T) is Health.HEALTHY
    b = ActiveHealth(HealthCheckConfig(healthy_threshold=3), joining=True)
    assert b.observe(P, 1) is Health.HEALTHY


def test_adaptive_timeout_follows_p99_within_floor_and_cap() -> None:
    cfg = HealthCheckConfig(timeout_ms=100, adaptive_k=4, adaptive_max_timeout_ms=5000, latency_window=100)
    a = ActiveHealth(cfg)
    assert a.timeout_ms() == 100  # no history: the floor
    for _ in range(99):
        a.observe(P, 5)
    assert a.timeout_ms() == 100  # 4 x 5 ms is under the floor
    a.observe(P, 400)  # one slow check in 100: p99 is 5 ms still (nearest rank 99)
    assert a.timeout_ms() == 100
    a.observe(P, 400)  # two in the last 100: p99 = 400 ms -> 1600 ms
    assert a.timeout_ms() == 1600
    for _ in range(10):
        a.observe(P, 3000)
    assert a.timeout_ms() == 5000  # capped
    off = ActiveHealth(HealthCheckConfig(timeout_ms=100, adaptive_timeout=False))
    off.observe(P, 3000)
    off.observe(T)
    assert off.timeout_ms() == 100


def test_consecutive_timeouts_double_the_timeout_so_a_pause_is_seen_to_end() -> None:
    cfg = HealthCheckConfig(timeout_ms=500, adaptive_max_timeout_ms=3000, unhealthy_threshold=3)
    a = ActiveHealth(cfg)
    a.observe(P, 2)
    assert [a.timeout_ms(), a.observe(T) and a.timeout_ms(), a.observe(T) and a.timeout_ms()] == [500, 1000, 2000]
    assert a.state is Health.HEALTHY  # a 3 s pause answers within the third, 2 s probe: never evicted
    a.observe(T)
    assert a.state is Health.UNHEALTHY and a.timeout_ms() == 3000  # a hung backend still goes, capped
    a.observe(F)
    assert a.timeout_ms() == 500  # only timeouts in a row grow it


def test_failed_checks_do_not_pollute_latency_window() -> None:
    a = ActiveHealth(HealthCheckConfig(timeout_ms=100, adaptive_k=2))
    a.observe(P, 80)
    a.observe(F, 100)
    assert list(a.latencies_ms) == [80]
    assert a.timeout_ms() == 160


@given(st.lists(st.floats(min_value=0, max_value=1e6, allow_nan=False), min_size=1, max_size=200), st.floats(0.1, 100))
def test_percentile_is_an_element_and_monotone(values: list[float], q: float) -> None:
    p = nearest_rank_percentile(values, q)
    assert p in values
    assert nearest_rank_percentile(values, 100) == max(values)
    assert sum(1 for v in values if v <= p) * 100 >= q * len(values) - 1e-6


@settings(max_examples=200)
@given(st.lists(st.sampled_from([P, F, T, R]), max_size=60), st.integers(1, 4), st.integers(1, 4))
def test_state_is_determined_by_the_last_run(events: list[CheckResult], h: int, u: int) -> None:
    """Property: HEALTHY after >= h trailing passes; UNHEALTHY after >= u trailing failures or one refusal."""
    a = ActiveHealth(HealthCheckConfig(healthy_threshold=h, unhealthy_threshold=u))
    for e in events:
        a.observe(e, 1.0)
    if not events:
        assert a.state is Health.UNKNOWN
        return
    trailing = 0
    for e in reversed(events):
        if (e is P) != (events[-1] is P):
            break
        trailing += 1
    if events[-1] is P and (trailing >= h or trailing == len(events)):
        assert a.state is Health.HEALTHY
    if events[-1] is not P and (trailing >= u or R in events[-trailing:]):
        assert a.state is Health.UNHEALTHY


# ------------------------------------------------------------------------------------ outliers


def test_consecutive_5xx_ejects_and_success_resets() -> None:
    fh = fleet(4, outliers=OutlierConfig(consecutive_5xx=3))
    for _ in range(2):
        assert fh.on_outcome("b0", Outcome.STATUS_5XX, 0.0) is None
    assert fh.on_outcome("b0", Outcome.SUCCESS, 0.0) is None
    assert fh.on_outcome("b0", Outcome.STATUS_5XX, 0.0) is None
    assert fh.on_outcome("b0", Outcome.STATUS_5XX, 0.0) is None
    change = fh.on_outcome("b0", Outcome.STATUS_5XX, 1.0)
    assert change is not None and change.health is Health.UNHEALTHY and change.cause == "ejected_5xx"
    assert fh.ejected("b0")


def test_connect_failures_and_stream_failures_have_their_own_thresholds() -> None:
    fh = fleet(4, outliers=OutlierConfig(consecutive_connect_failures=1, consecutive_stream_failures=2))
    assert fh.on_outcome("b0", Outcome.CONNECT_FAILURE, 0.0) is not None
    assert fh.on_outcome("b1", Outcome.STREAM_FAILURE, 0.0) is None
    assert fh.on_outcome("b1", Outcome.STREAM_FAILURE, 0.0) is not None
    assert fh.health("b1") is Health.UNHEALTHY


def test_ejection_grows_with_repeats_and_returns_on_passing_check() -> None:
    cfg = OutlierConfig(consecutive_5xx=1, base_ejection_ms=1000, max_ejection_ms=2500, decay_ms=100_000)
    fh = fleet(4, outliers=cfg)
    fh.on_check("b0", P, 1.0, 0.0)
    fh.on_outcome("b0", Outcome.STATUS_5XX, 0.0)
    assert fh.next_expiry() == pytest.approx(1.0)
    assert fh.on_check("b0", P, 1.0, 0.5) is None  # a pass before the time is up does not end it
    assert fh.tick(1.0) == []  # expired, but with active checks it waits for a pass
    assert fh.health("b0") is Health.UNHEALTHY
    change = fh.on_check("b0", P, 1.0, 1.1)
    assert change is not None and change.health is Health.HEALTHY
    fh.on_outcome("b0", Outcome.STATUS_5XX, 2.0)
    assert fh.next_expiry() == pytest.approx(4.0)  # second ejection: 2 x base
    fh.on_check("b0", P, 1.0, 4.0)
    fh.on_outcome("b0", Outcome.STATUS_5XX, 5.0)
    assert fh.next_expiry() == pytest.approx(7.5)  # third: 3 x base capped at 2.5 s


def test_ejection_multiplier_decays() -> None:
    cfg = OutlierConfig(consecutive_5xx=1, base_ejection_ms=1000, decay_ms=10_000)
    fh = fleet(2, HealthCheckConfig(enabled=False), cfg)
    fh.on_outcome("b0", Outcome.STATUS_5XX, 0.0)
    fh.tick(1.0)
    fh.on_outcome("b0", Outcome.STATUS_5XX, 1.0)
    assert fh.next_expiry() == pytest.approx(3.0)
    fh.tick(3.0)
    fh.on_outcome("b0", Outcome.STATUS_5XX, 30.0)  # two decay periods later: back to one base
    assert fh.next_expiry() == pytest.approx(31.0)


def test_without_active_checks_ejection_expires_on_time() -> None:
    fh = fleet(2, HealthCheckConfig(enabled=False), OutlierConfig(consecutive_5xx=1, base_ejection_ms=500))
    fh.on_outcome("b1", Outcome.STATUS_5XX, 10.0)
    assert fh.tick(10.4) == []
    changes = fh.tick(10.5)
    assert [(c.name, c.health, c.cause) for c in changes] == [("b1", Health.UNKNOWN, "ejection_expired")]


@pytest.mark.parametrize("n, pct, allowed", [(4, 50, 2), (10, 10, 1), (3, 10, 1), (5, 100, 5), (4, 0, 1), (7, 30, 2)])
def test_max_ejection_percent_caps_ejections(n: int, pct: float, allowed: int) -> None:
    fh = fleet(n, outliers=OutlierConfig(consecutive_5xx=1, max_ejection_percent=pct))
    for i in range(n):
        fh.on_outcome(f"b{i}", Outcome.STATUS_5XX, 0.0)
    assert fh.ejected_count() == allowed


def test_disabled_outlier_detection_never_ejects() -> None:
    fh = fleet(2, outliers=OutlierConfig(enabled=False, consecutive_5xx=1))
    assert fh.on_outcome("b0", Outcome.STATUS_5XX, 0.0) is None
    assert not fh.ejected("b0")


def test_removed_backend_events_are_ignored_and_reconfigure_keeps_state() -> None:
    fh = fleet(2)
    fh.on_check("b0", P, 7.0, 0.0)
    fh.remove("b1")
    assert fh.on_check("b1", P, 1.0, 0.0) is None
    assert fh.on_outcome("b1", Outcome.STATUS_5XX, 0.0) is None
    fh.reconfigure(HealthCheckConfig(latency_window=8, timeout_ms=10, adaptive_k=2), OutlierConfig())
    assert fh.check_latencies_ms("b0") == (7.0,)
    assert fh.timeout_s("b0") == pytest.approx(0.014)
    assert fh.names == ("b0",) and "b0" in fh and "b1" not in fh


def test_joiner_with_checks_disabled_is_routable_at_once() -> None:
    fh = FleetHealth(HealthCheckConfig(enabled=False), OutlierConfig())
    assert fh.add("new", joining=True) is Health.UNKNOWN
    fh2 = FleetHealth(HealthCheckConfig(), OutlierConfig())
    assert fh2.add("new", joining=True) is Health.UNHEALTHY


@settings(max_examples=150)
@given(
    st.lists(
        st.tuples(st.integers(0, 5), st.sampled_from(list(Outcome)), st.floats(0, 2.0), st.booleans()),
        max_size=80,
    ),
    st.floats(0, 100),
)
def test_never_more_than_the_allowed_share_ejected(events, pct: float) -> None:
    n = 6
    fh = fleet(n, outliers=OutlierConfig(consecutive_5xx=1, consecutive_connect_failures=1,
                                         consecutive_stream_failures=1, max_ejection_percent=pct,
                                         base_ejection_ms=500))
    allowed = max(1, int(n * pct / 100 + 1e-9))
    now = 0.0
    for idx, outcome, dt, check in events:
        now += dt
        fh.tick(now)
        if check:
            fh.on_check(f"b{idx}", P, 1.0, now)
        fh.on_outcome(f"b{idx}", outcome, now)
        assert fh.ejected_count() <= allowed


# ------------------------------------------------------------------------------------------ retries


def test_retryable_conditions() -> None:
    cfg = RetryConfig()
    assert retryable(cfg, Outcome.CONNECT_FAILURE)
    assert retryable(cfg, Outcome.RESET)
    assert retryable(cfg, Outcome.STATUS_5XX, 503)
    assert retryable(cfg, Outcome.SUCCESS, 429)
    assert not retryable(cfg, Outcome.STATUS_5XX, 500)
    assert not retryable(cfg, Outcome.STREAM_FAILURE)  # never after the first streamed byte
    assert not retryable(cfg, Outcome.SUCCESS, 200)
    assert not retryable(RetryConfig(enabled=False), Outcome.CONNECT_FAILURE)
    assert not retryable(RetryConfig(retry_on=("503",)), Outcome.RESET)


def test_backoff_is_full_jitter_exponential_and_capped() -> None:
    cfg = RetryConfig(backoff_base_ms=10, backoff_max_ms=50)
    assert backoff_s(cfg, 1, 0.0) == 0
    assert backoff_s(cfg, 1, 0.5) == pytest.approx(0.005)
    assert backoff_s(cfg, 2, 0.5) == pytest.approx(0.010)
    assert backoff_s(cfg, 3, 0.999) == pytest.approx(0.03996)
    assert backoff_s(cfg, 10, 0.5) == pytest.approx(0.025)


def test_retry_budget_is_a_share_of_requests_plus_a_floor() -> None:
    b = RetryBudget(RetryConfig(budget_percent=20, min_retries_per_s=0, budget_window_ms=10_000))
    for _ in range(100):
        b.on_request(1.0)
    granted = sum(b.try_acquire(1.0) for _ in range(50))
    assert granted == 20
    # the window slides: after it has passed, the old requests and retries are forgotten
    assert b.allowed(11.5) == 0
    for _ in range(10):
        b.on_request(12.0)
    assert b.allowed(12.0) == 2
    floor = RetryBudget(RetryConfig(budget_percent=0, min_retries_per_s=1, budget_window_ms=2000))
    assert sum(floor.try_acquire(0.0) for _ in range(5)) == 2


@settings(max_examples=100)
@given(st.lists(st.tuples(st.floats(0, 0.5), st.booleans()), max_size=300))
def test_retries_never_exceed_budget_within_a_window(steps) -> None:
    cfg = RetryConfig(budget_percent=20, min_retries_per_s=1, budget_window_ms=1000)
    b = RetryBudget(cfg)
    now = 0.0
    for dt, is_retry in steps:
        now += dt
        if is_retry:
            if b.try_acquire(now):  # at the moment a retry is granted, the window holds it within budget
                assert b.retries <= b.requests * 0.2 + 1 + 1e-9
        else:
            b.on_request(now)


# ------------------------------------------------------------------------------------ overload + panic


def state(name: str, health: Health = Health.HEALTHY, max_inflight: int | None = None, signals: Signals | None = None,
          stale: bool = False, weight: float | None = None) -> BackendState:
    return BackendState(spec=BackendSpec(name=name, url="http://127.0.0.1:1", max_inflight=max_inflight),
                        health=health, signals=signals, stale=stale, weight=weight)


def test_saturation_by_inflight_queue_and_kv() -> None:
    cfg = OverloadConfig(max_inflight_per_backend=4, max_waiting=8, max_kv_usage=0.95)
    assert not saturated(state("a"), Inflight(3), cfg)
    assert saturated(state("a"), Inflight(4), cfg)
    assert not saturated(state("a", max_inflight=10), Inflight(4), cfg)  # its own limit wins
    busy = Signals(scraped_at=0, waiting=9, kv_usage=0.5)
    full = Signals(scraped_at=0, waiting=0, kv_usage=0.99)
    assert saturated(state("a", signals=busy), None, cfg)
    assert saturated(state("a", signals=full), None, cfg)
    assert not saturated(state("a", signals=full, stale=True), None, cfg)  # stale telemetry is not trusted
    assert not saturated(state("a", signals=Signals(scraped_at=0)), None, cfg)  # unreported is not zero nor full
    snap = Snapshot(1, (state("a"), state("b", health=Health.UNHEALTHY), state("c")))
    assert saturated_names(snap, {"a": Inflight(4), "b": Inflight(9)}, cfg) == {"a"}


@settings(max_examples=300, deadline=None)
@given(limit=st.one_of(st.none(), st.integers(1, 4)), own=st.one_of(st.none(), st.integers(1, 4)),
       waiting=st.one_of(st.none(), st.floats(0, 20)), kv=st.one_of(st.none(), st.floats(0, 1)),
       max_waiting=st.one_of(st.none(), st.integers(0, 20)), max_kv=st.one_of(st.none(), st.floats(0.01, 1)),
       signals=st.booleans(), stale=st.booleans(), inflight=st.one_of(st.none(), st.integers(0, 6)))
def test_may_saturate_holds_every_backend_saturated_can_call_saturated(
        limit, own, waiting, kv, max_waiting, max_kv, signals, stale, inflight) -> None:
    # The router asks `saturated` only about the backends `may_saturate` names: it must never miss one.
    cfg = OverloadConfig(max_inflight_per_backend=limit, max_waiting=max_waiting, max_kv_usage=max_kv)
    b = state("a", max_inflight=own, stale=stale,
              signals=Signals(scraped_at=0, waiting=waiting, kv_usage=kv) if signals else None)
    capped = may_saturate(Snapshot(1, (b,)), cfg)
    if saturated(b, None if inflight is None else Inflight(inflight), cfg):
        assert capped == {"a"}
    if limit is None and own is None and (not signals or stale or (max_waiting is None and max_kv is None)):
        assert capped == frozenset()


def test_panic_routes_to_all_below_threshold() -> None:
    snap = Snapshot(3, (state("a"), state("b", Health.UNHEALTHY), state("c", Health.UNHEALTHY),
                        state("d", Health.DRAINING), state("e", weight=0)))
    assert in_panic(snap, 50)  # 1 of 3 candidates routable
    assert not in_panic(snap, 30)
    view = PanicView(50)
    v = view(snap)
    assert view.panicking and v.version == 3
    assert [b.health for b in v.backends] == [Health.HEALTHY, Health.UNKNOWN, Health.UNKNOWN, Health.DRAINING,
                                              Health.HEALTHY]
    assert view(snap) is v  # cached per snapshot
    calm = Snapshot(4, (state("a"), state("b")))
    assert view(calm) is calm and not view.panicking
    assert not in_panic(Snapshot(5, ()), 50)
    assert not in_panic(snap, 0)


def test_joining_backends_neither_cause_panic_nor_get_panic_traffic() -> None:
    snap = Snapshot(1, (state("a"), state("b"), state("new1", Health.UNHEALTHY), state("new2", Health.UNHEALTHY),
                        state("new3", Health.UNHEALTHY)))
    assert in_panic(snap, 50)  # counted as failed, three joiners would trigger panic ...
    joining = {"new1", "new2", "new3"}
    assert not in_panic(snap, 50, joining)  # ... but they are not serving yet
    sick = Snapshot(2, (state("a"), state("b", Health.UNHEALTHY), state("c", Health.UNHEALTHY),
                        state("new1", Health.UNHEALTHY)))
    view = PanicView(50, lambda: {"new1"})(sick)
    assert [b.health for b in view.backends] == [Health.HEALTHY, Health.UNKNOWN, Health.UNKNOWN, Health.UNHEALTHY]
    fh = FleetHealth(HealthCheckConfig(), OutlierConfig())
    fh.add("old")
    fh.add("new", joining=True)
    assert fh.joining() == {"new"}
    fh.on_check("new", P, 1.0, 0.0)
    assert fh.joining() == frozenset()


def test_describe_reports_each_machine() -> None:
    fh = fleet(2, HealthCheckConfig(timeout_ms=100, adaptive_k=2), OutlierConfig(consecutive_5xx=1,
                                                                                 base_ejection_ms=2000))
    fh.on_check("b0", P, 80.0, 0.0)
    fh.on_check("b0", T, None, 0.5)
    fh.on_outcome("b1", Outcome.STATUS_5XX, 1.0)
    d = fh.describe(1.5)
    assert d["b0"]["consecutive_timeouts"] == 1 and d["b0"]["next_timeout_ms"] == 320.0
    assert d["b0"]["check_p99_ms"] == 80.0 and d["b0"]["health"] == "healthy"
    assert d["b1"]["ejected"] and d["b1"]["ejected_for_s"] == 1.5 and d["b1"]["health"] == "unhealthy"
