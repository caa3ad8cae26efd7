"""The pure core of experiments: conditions, config checks, sticky assignment, guardrail evaluation."""

from __future__ import annotations

import random

import pytest

from proxy.config import ConfigError, parse_section
from proxy.core.bounds import ConfigValueError
from proxy.core.experiments import (
    ArmConfig, ArmWindow, ExperimentConfig, ExperimentsConfig, GuardrailConfig, assign, assignment_key,
    assignment_point, carry_state, evaluate, experiment_seed, initial_state, parse_condition, readings_from_windows,
)
from proxy.core.request import summary_from_openai
from proxy.core.routing_config import RoutingConfig


def ab(share: float = 0.5, **kw: object) -> ExperimentConfig:
    return ExperimentConfig(
        name="ab", control="stable",
        arms=(ArmConfig("stable"), ArmConfig("rr", share=share, routing=RoutingConfig(policy="round_robin"))),
        **kw,  # type: ignore[arg-type]  # test helper: the remaining ExperimentConfig fields
    )


def test_conditions_parse_the_three_forms() -> None:
    c = parse_condition("error_rate > 0.02")
    assert (c.metric, c.op, c.kind, c.value) == ("error_rate", ">", "absolute", 0.02)
    assert c.fires(0.03, None) and not c.fires(0.01, None) and not c.fires(None, None)
    r = parse_condition("ttft_p99 > 1.2 x control")
    assert r.kind == "ratio" and r.fires(1.3, 1.0) and not r.fires(1.1, 1.0) and not r.fires(5.0, None)
    p = parse_condition("hit_ratio < control - 5 points")
    assert p.kind == "points" and p.value == -5 and p.fires(0.5, 0.6) and not p.fires(0.57, 0.6)
    assert str(p) == "hit_ratio < control - 5 points"
    with pytest.raises(ValueError, match="cannot read condition"):
        parse_condition("error_rate >> 2")


def test_config_checks_itself_in_code_and_yaml() -> None:
    with pytest.raises(ConfigValueError, match="required for a candidate"):
        ExperimentConfig(name="x", control="a", arms=(ArmConfig("a"), ArmConfig("b")))
    with pytest.raises(ConfigValueError, match="must name one of the arms"):
        ExperimentConfig(name="x", control="zz", arms=(ArmConfig("a"), ArmConfig("b", share=0.1)))
    with pytest.raises(ConfigValueError, match="more than 1"):
        ExperimentConfig(name="x", control="a", arms=(ArmConfig("a"), ArmConfig("b", share=0.7), ArmConfig("c", share=0.7)))
    with pytest.raises(ConfigValueError, match="not one the proxy measures"):
        GuardrailConfig(when="gpu_temp > 80")
    with pytest.raises(ConfigValueError, match="prometheus_url: is required"):
        GuardrailConfig(when="gpu_temp > 80", source="prometheus", query="x{{arm='{arm}'}}")
    with pytest.raises(ConfigError) as err:
        parse_section(ExperimentsConfig, """
definitions:
  - name: ab
    control: stable
    arms:
      - {name: stable}
      - {name: rr, share: 0.5, routing: {policy: round_robinn}}
    guardrails:
      - {when: "error_rate > 0.02", factor: 1.5}
""")
    text = "\n".join(err.value.errors)
    assert "did you mean 'round_robin'" in text and "factor" in text and "(line 7)" in text


def test_overlapping_experiments_are_refused() -> None:
    with pytest.raises(ConfigValueError, match="overlaps"):
        ExperimentsConfig(definitions=(ab(), ExperimentConfig(name="b", control="a",
                                                                arms=(ArmConfig("a"), ArmConfig("c", share=0.1)))))


def test_assignment_key_prefers_session_then_conversation_prefix_then_prompt() -> None:
    turn1 = summary_from_openai("/v1/chat/completions", {"messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]})
    turn2 = summary_from_openai("/v1/chat/completions", {"messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]})
    assert assignment_key(turn1) == assignment_key(turn2)
    other = summary_from_openai("/v1/chat/completions", {"messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "something else"}]})
    assert assignment_key(other) != assignment_key(turn1)
    with_session = summary_from_openai("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]},
                                       session_key="sess-1")
    assert assignment_key(with_session) == b"s\xffsess-1"
    plain = summary_from_openai("/v1/completions", {"prompt": "abc"})
    assert assignment_key(plain) == b"f\xffabc"


def test_shares_are_met_and_a_cut_never_moves_a_point_into_a_candidate() -> None:
    cfg = ExperimentConfig(name="three", control="c", arms=(
        ArmConfig("c"), ArmConfig("a", share=0.2), ArmConfig("b", share=0.3)))
    seed = experiment_seed(cfg.name)
    rng = random.Random(1)
    points = [assignment_point(rng.randbytes(12), seed) for _ in range(20000)]
    full = {"a": 0.2, "b": 0.3}
    arms = [assign(cfg, full, p) for p in points]
    assert abs(arms.count("a") / len(arms) - 0.2) < 0.015 and abs(arms.count("b") / len(arms) - 0.3) < 0.015
    for weights in ({"a": 0.05, "b": 0.3}, {"a": 0.2, "b": 0.01}, {"a": 0.0, "b": 0.0}):
        cut = [assign(cfg, weights, p) for p in points]
        for before, after in zip(arms, cut):
            # nothing enters a candidate it was not in; only candidate -> control moves
            assert after == before or after == "c"
        for name, w in weights.items():
            assert abs(cut.count(name) / len(cut) - w) < 0.015
    assert assign(cfg, full, 0.1, promoted="b") == "b"
    # the same key and name give the same point, whatever process computes it
    assert assignment_point(b"k", seed) == assignment_point(b"k", experiment_seed("three"))
    assert assignment_point(b"k", seed) != assignment_point(b"k", experiment_seed("other"))


def rule_windows(rr_errors: int, n: int = 100) -> dict[str, ArmWindow]:
    return {"stable": ArmWindow(requests=n, errors=0, ttft_p99=0.1), "rr": ArmWindow(requests=n, errors=rr_errors, ttft_p99=0.1)}


def test_guardrail_cuts_with_floor_and_cooldown_then_restores_after_a_clean_window() -> None:
    cfg = ab(guardrails=(GuardrailConfig("error_rate > 0.02", factor=0.3),), floor=0.1, cooldown_s=10,
             restore_after_s=20, restore_factor=2.0)
    st = initial_state(cfg)
    assert st.weights() == {"rr": 0.5}
    bad = readings_from_windows(cfg, rule_windows(10))
    st, acts = evaluate(cfg, st, bad, now=100)
    assert [(a.kind, a.old_weight, round(a.new_weight, 6)) for a in acts] == [("cut", 0.5, 0.15)]
    assert "error_rate 0.1" in acts[0].reasons[0] and "weight x 0.3" in acts[0].reasons[0]
    st, acts = evaluate(cfg, st, bad, now=105)  # cooling down
    assert acts == [] and st.weights() == {"rr": 0.15}
    st, acts = evaluate(cfg, st, bad, now=111)
    assert [(a.kind, a.new_weight) for a in acts] == [("cut", 0.1)]  # the floor
    st, acts = evaluate(cfg, st, bad, now=125)
    assert acts == []  # at the floor: nothing to cut
    good = readings_from_windows(cfg, rule_windows(0))
    st, acts = evaluate(cfg, st, good, now=130)
    assert acts == []  # clean since 130
    st, acts = evaluate(cfg, st, good, now=149)
    assert acts == []
    st, acts = evaluate(cfg, st, good, now=150)
    assert [(a.kind, a.new_weight) for a in acts] == [("restore", 0.2)]
    st, _ = evaluate(cfg, st, good, now=170)
    st, acts = evaluate(cfg, st, good, now=190)
    assert st.weights() == {"rr": 0.5} and acts[0].new_weight == 0.5  # capped at the configured share


def test_too_few_requests_are_not_judged_and_relative_rules_need_control() -> None:
    cfg = ab(guardrails=(GuardrailConfig("ttft_p99 > 1.2 x control", factor=0.5, min_requests=50),))
    windows = {"stable": ArmWindow(requests=100, ttft_p99=0.1), "rr": ArmWindow(requests=10, ttft_p99=1.0)}
    st, acts = evaluate(cfg, initial_state(cfg), readings_from_windows(cfg, windows), now=0)
    assert acts == []
    windows = {"stable": ArmWindow(requests=10, ttft_p99=0.1), "rr": ArmWindow(requests=100, ttft_p99=1.0)}
    st, acts = evaluate(cfg, initial_state(cfg), readings_from_windows(cfg, windows), now=0)
    assert acts == []
    windows = {"stable": ArmWindow(requests=100, ttft_p99=0.1), "rr": ArmWindow(requests=100, ttft_p99=0.13)}
    st, acts = evaluate(cfg, initial_state(cfg), readings_from_windows(cfg, windows), now=0)
    assert [a.new_weight for a in acts] == [0.25] and "control 0.1" in acts[0].reasons[0]


def test_hit_ratio_rule_in_points_and_prometheus_readings() -> None:
    cfg = ab(guardrails=(
        GuardrailConfig("hit_ratio < control - 5 points", factor=0.5),
        GuardrailConfig("p99 > 2", factor=0.2, source="prometheus", prometheus_url="http://p:9090", query="q{arm='{arm}'}"),
    ))
    windows = {"stable": ArmWindow(requests=100, prompt_tokens=1000, cached_tokens=600),
               "rr": ArmWindow(requests=100, prompt_tokens=1000, cached_tokens=560)}
    readings = readings_from_windows(cfg, windows)
    assert 1 not in readings  # not a proxy rule
    _, acts = evaluate(cfg, initial_state(cfg), readings, now=0)
    assert acts == []  # 56% vs 60%: within 5 points
    windows["rr"] = ArmWindow(requests=100, prompt_tokens=1000, cached_tokens=500)
    _, acts = evaluate(cfg, initial_state(cfg), {**readings_from_windows(cfg, windows), 1: {"rr": 3.0}}, now=0)
    assert len(acts) == 1 and acts[0].new_weight == pytest.approx(0.1) and len(acts[0].reasons) == 2


def test_auto_promote_and_reload_keeps_unchanged_arms() -> None:
    cfg = ab(auto_promote_after_s=30)
    st, acts = evaluate(cfg, initial_state(cfg), {}, now=0)
    assert acts == []
    st, acts = evaluate(cfg, st, {}, now=30)
    assert [a.kind for a in acts] == ["promote"] and st.promoted == "rr"
    assert assign(cfg, st.weights(), 0.99, st.promoted) == "rr"
    cut_cfg = ab(guardrails=(GuardrailConfig("error_rate > 0.02", factor=0.3),))
    st, _ = evaluate(cut_cfg, initial_state(cut_cfg), readings_from_windows(cut_cfg, rule_windows(10)), now=0)
    kept = carry_state(cut_cfg, st, ab(guardrails=(GuardrailConfig("error_rate > 0.05", factor=0.3),)))
    assert kept.weights() == {"rr": pytest.approx(0.15)}
    reset = carry_state(cut_cfg, st, ab(share=0.4))
    assert reset.weights() == {"rr": 0.4}


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_experiment_numbers_must_be_finite(bad: float) -> None:
    for name in ("floor", "cooldown_s", "restore_after_s", "restore_factor", "auto_promote_after_s"):
        with pytest.raises(ConfigValueError, match=f"{name}: must be a finite number"):
            ab(**{name: bad})
    with pytest.raises(ConfigValueError, match="share: must be a finite number"):
        ArmConfig("x", share=bad)
