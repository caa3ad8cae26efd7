"""effective_load and the routing: configuration section."""

from __future__ import annotations

import dataclasses

import pytest

from proxy.config import ConfigError, parse_section
from proxy.core.decision import Inflight
from proxy.core.load import assumed_score, effective_load, fleet_loads, inflight_load
from proxy.core.registry import build_policy
from proxy.core.routing_config import AffinityConfig, LoadConfig, RoutingConfig
from proxy.core.snapshot import BackendSpec, BackendState, Signals

from .helpers import fleet, fresh


def state(score=None, stale=True, max_inflight=None, kv=None):
    return BackendState(
        spec=BackendSpec("b", "http://b", max_inflight=max_inflight),
        load_score=score,
        stale=stale,
        signals=Signals(scraped_at=0.0, kv_capacity_tokens=kv) if kv is not None else None,
    )


def test_fresh_score_plus_inflight():
    assert effective_load(state(0.4, stale=False), Inflight()) == pytest.approx(0.4)
    assert effective_load(state(0.4, stale=False), Inflight(requests=16)) == pytest.approx(0.4 + 16 / 64)
    assert effective_load(state(0.4, stale=False, max_inflight=8), Inflight(requests=4)) == pytest.approx(0.9)


def test_tokens_normalised_by_reported_kv_capacity():
    s = state(0.0, stale=False, kv=10_000)
    assert inflight_load(s, Inflight(requests=1, tokens=5_000)) == pytest.approx(0.5)
    assert inflight_load(state(), Inflight(tokens=262144)) == pytest.approx(1.0)


def test_stale_or_missing_telemetry_is_never_zero():
    cfg = LoadConfig(stale_score=0.5)
    assert effective_load(state(0.1, stale=True), None, cfg) == pytest.approx(0.5)  # stale value ignored
    assert effective_load(state(None, stale=False), None, cfg) == pytest.approx(0.5)  # no usable terms
    assert effective_load(state(None), Inflight(requests=64), cfg) == pytest.approx(1.5)
    assert effective_load(state(None), None, cfg, assumed=0.8) == pytest.approx(0.8)


def test_assumed_score_is_fleet_mean_or_floor():
    snap = fresh(fleet(3), {"gpu-0": 0.9, "gpu-1": 0.7})
    assert assumed_score(snap.backends) == pytest.approx(0.8)
    assert assumed_score(fresh(fleet(2), {"gpu-0": 0.1}).backends) == pytest.approx(0.5)
    loads = fleet_loads(snap.backends, {"gpu-2": Inflight(requests=32)})
    assert loads == pytest.approx({"gpu-0": 0.9, "gpu-1": 0.7, "gpu-2": 0.8 + 0.5})


def test_defaults_and_plain_types_for_the_config_parser():
    cfg = RoutingConfig()
    assert cfg.policy == "affinity" and cfg.affinity.epsilon == 0.25 and cfg.affinity.request_epsilon == 1.5
    allowed = (str, int, float, bool, tuple, type(None))
    for section in (cfg, cfg.affinity, cfg.load):
        assert dataclasses.is_dataclass(section)
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            assert dataclasses.is_dataclass(value) or isinstance(value, allowed), f.name
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.policy = "random"  # type: ignore[misc]  # the point: a frozen section refuses assignment


@pytest.mark.parametrize(
    "build, field",
    [
        (lambda: build_policy(RoutingConfig(policy="fastest")), "policy"),
        (lambda: RoutingConfig(session_header=" "), "session_header"),
        (lambda: AffinityConfig(epsilon=0), "epsilon"),
        (lambda: AffinityConfig(block_bytes=8), "block_bytes"),
        (lambda: AffinityConfig(min_prefix_ratio=1.5), "min_prefix_ratio"),
        (lambda: AffinityConfig(fingerprint_fields=("prompt", "top_p")), "fingerprint_fields"),
        (lambda: AffinityConfig(fingerprint_fields=()), "fingerprint_fields"),
        (lambda: AffinityConfig(index_blocks=100, index_max_blocks=10), "index_max_blocks"),
        (lambda: LoadConfig(stale_score=2.0), "stale_score"),
        (lambda: LoadConfig(inflight_requests_full=0), "inflight_requests_full"),
    ],
)
def test_invalid_values_name_their_field(build, field):
    with pytest.raises(ValueError, match=field):
        build()


def test_parses_from_yaml_with_the_project_parser():
    text = """
policy: affinity
session_header: null
seed: 3
affinity:
  epsilon: 0.5
  block_bytes: 512
  fingerprint_fields: [prompt, max_tokens]
load:
  stale_score: 0.7
"""
    cfg = parse_section(RoutingConfig, text)
    assert cfg == RoutingConfig(
        session_header=None,
        seed=3,
        affinity=AffinityConfig(epsilon=0.5, block_bytes=512, fingerprint_fields=("prompt", "max_tokens")),
        load=LoadConfig(stale_score=0.7),
    )
    with pytest.raises(ConfigError) as err:
        parse_section(RoutingConfig, "affinity:\n  epsilon: -1\n  blok_bytes: 3\n")
    text_err = "\n".join(err.value.errors)
    assert "affinity.epsilon (line 2)" in text_err and "did you mean" in text_err
