"""The load score: the design's formula by default, the two alternatives, and unknown never reads as idle."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.core.score import (
    ScoreConfig,
    design_score,
    load_score,
    qps_alpha,
    request_cost_s,
)
from proxy.core.snapshot import Signals


def sig(**kw: object) -> Signals:
    return Signals(scraped_at=0.0, **kw)  # type: ignore[arg-type]


def test_design_formula_defaults() -> None:
    s = sig(mem_used_bytes=40.0, mem_total_bytes=80.0, kernel_queue=50.0, kv_tokens_per_s=256.0)
    assert load_score(s, ScoreConfig()) == pytest.approx(0.4 * 0.5 + 0.35 * 0.5 + 0.25 * 0.5)


def test_design_terms_saturate_at_one() -> None:
    s = sig(mem_used_bytes=80.0, mem_total_bytes=80.0, kernel_queue=1000.0, kv_tokens_per_s=10_000.0)
    assert load_score(s, ScoreConfig()) == pytest.approx(1.0)
    idle = sig(mem_used_bytes=0.0, mem_total_bytes=80.0, kernel_queue=0.0, kv_tokens_per_s=0.0)
    assert load_score(idle, ScoreConfig()) == 0.0


def test_weights_and_normalisers_are_configurable() -> None:
    cfg = ScoreConfig(memory_weight=0.0, queue_weight=1.0, kv_rate_weight=0.0, queue_full=10.0)
    assert load_score(sig(kernel_queue=5.0, mem_used_bytes=80.0, mem_total_bytes=80.0), cfg) == 0.5


def test_missing_terms_are_left_out_not_read_as_zero() -> None:
    # only the queue is known and it is full: the backend is full, not 35% loaded
    assert load_score(sig(kernel_queue=500.0), ScoreConfig()) == pytest.approx(1.0)
    assert load_score(sig(), ScoreConfig()) is None
    assert load_score(None, ScoreConfig()) is None


def test_engine_fallbacks_kv_usage_for_memory_and_running_plus_waiting_for_queue() -> None:
    s = sig(kv_usage=0.5, running=30.0, waiting=20.0)
    assert design_score(s, ScoreConfig()) == pytest.approx((0.4 * 0.5 + 0.35 * 0.5) / 0.75)


@pytest.mark.parametrize(("latency", "alpha"), [(0.0, 0.7), (200.0, 0.7), (1000.0, 0.5), (1800.0, 0.3),
                                                (5000.0, 0.3), (None, 0.5)])
def test_qps_alpha_adapts_to_latency(latency: float | None, alpha: float) -> None:
    assert qps_alpha(latency, ScoreConfig()) == pytest.approx(alpha)


def test_qps_memory_score() -> None:
    cfg = ScoreConfig(kind="qps_memory", qps_full=100.0)
    s = sig(qps=50.0, kv_usage=1.0, latency_ms=1000.0)
    assert load_score(s, cfg) == pytest.approx(0.5 * 0.5 + 0.5 * 1.0)
    # with high latency memory dominates
    slow = sig(qps=50.0, kv_usage=1.0, latency_ms=4000.0)
    assert load_score(slow, cfg) == pytest.approx(0.3 * 0.5 + 0.7 * 1.0)


def test_request_cost_prefers_a_cache_hit_on_a_busier_backend() -> None:
    cfg = ScoreConfig()
    busy_hit = request_cost_s(200, 64, sig(running=16.0, waiting=0.0), cfg)
    idle_miss = request_cost_s(8000, 64, sig(running=0.0, waiting=0.0), cfg)
    assert busy_hit < idle_miss


def test_request_cost_components() -> None:
    cfg = ScoreConfig(prefill_tokens_per_s=1000.0, decode_s_per_token=0.01, batch_slowdown_per_seq=0.1,
                      queue_s_per_waiting=0.5)
    cost = request_cost_s(2000, 100, sig(running=10.0, waiting=2.0), cfg)
    assert cost == pytest.approx(2 * 0.5 + 2.0 + 100 * 0.01 * 2.0)


def test_request_cost_without_telemetry_uses_inflight_not_zero() -> None:
    cfg = ScoreConfig()
    assert request_cost_s(0, 100, None, cfg, inflight_requests=50) > request_cost_s(0, 100, None, cfg)


def test_request_cost_score_kind() -> None:
    cfg = ScoreConfig(kind="request_cost")
    low = load_score(sig(running=1.0, waiting=0.0), cfg)
    high = load_score(sig(running=200.0, waiting=100.0), cfg)
    assert low is not None and high is not None and 0 <= low < high <= 1
    assert load_score(sig(kv_usage=0.5), cfg) is None


@pytest.mark.parametrize("bad", [dict(kind="nope"), dict(queue_full=0), dict(memory_weight=-1),
                                 dict(alpha_min=0.8, alpha_max=0.2),
                                 dict(memory_weight=0, queue_weight=0, kv_rate_weight=0)])
def test_config_validation(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        ScoreConfig(**bad)  # type: ignore[arg-type]


opt = st.none() | st.floats(min_value=0, max_value=1e12, allow_nan=False)


@given(mem=opt, total=st.none() | st.floats(min_value=1, max_value=1e12), q=opt, rate=opt, kv=opt, run=opt,
       wait=opt, qps=opt, lat=opt, kind=st.sampled_from(["design", "qps_memory", "request_cost"]))
def test_score_is_in_unit_interval_or_unknown(mem, total, q, rate, kv, run, wait, qps, lat, kind) -> None:
    s = sig(mem_used_bytes=mem, mem_total_bytes=total, kernel_queue=q, kv_tokens_per_s=rate, kv_usage=kv,
            running=run, waiting=wait, qps=qps, latency_ms=lat)
    score = load_score(s, ScoreConfig(kind=kind))
    assert score is None or 0.0 <= score <= 1.0
