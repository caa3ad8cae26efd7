"""The one bounds checker: every section checks itself when built, finite numbers everywhere."""

from __future__ import annotations

import dataclasses
import math

import pytest

from proxy.config import AdminConfig, Config, DiscoveryConfig, LimitsConfig, ListenConfig, TimeoutsConfig, UpstreamConfig
from proxy.control.telemetry_config import TelemetryConfig
from proxy.control.lora_pool import LoraPoolConfig
from proxy.core.bounds import ConfigValueError, check_value, config_errors, value_errors
from proxy.core.experiments import ExperimentsConfig, GuardrailConfig
from proxy.core.health import HealthCheckConfig, OutlierConfig
from proxy.core.hotspots import HotspotConfig
from proxy.core.overload import OverloadConfig
from proxy.core.retry_policy import RetryConfig
from proxy.core.routing_config import AffinityConfig, LoadConfig, RoutingConfig
from proxy.core.score import ScoreConfig
from proxy.core.snapshot import WEIGHT_BOUNDS, BackendSpec, BackendState, Snapshot
from proxy.observability.config import AccessLogConfig, LoggingConfig, TracingConfig

SECTIONS = (HealthCheckConfig, OutlierConfig, RetryConfig, OverloadConfig, RoutingConfig, AffinityConfig,
            LoadConfig, ScoreConfig, TelemetryConfig, DiscoveryConfig, ListenConfig, LimitsConfig, TimeoutsConfig,
            UpstreamConfig, AdminConfig, HotspotConfig, LoggingConfig, AccessLogConfig, TracingConfig,
            ExperimentsConfig, GuardrailConfig, LoraPoolConfig)
NON_FINITE = (math.inf, -math.inf, math.nan)


def test_value_errors() -> None:
    assert value_errors(1.0, {"ge": 0}) == []
    assert value_errors(None, {"ge": 0}) == []
    assert value_errors(-1, {"ge": 0}) == ["must be >= 0, got -1"]
    assert value_errors(math.nan, {}) == ["must be a finite number, got nan"]
    assert value_errors(math.inf, {"ge": 0}) == ["must be a finite number, got inf"]
    assert value_errors(True, {"ge": 5}) == []  # booleans are not numbers here
    assert value_errors("", {"min_len": 1}) == ["must not be empty"]
    with pytest.raises(ValueError, match="^weight: must be a finite number"):
        check_value("weight", math.inf, WEIGHT_BOUNDS)


@pytest.mark.parametrize("cls", SECTIONS)
def test_every_float_field_of_every_section_refuses_non_finite_numbers(cls: type) -> None:
    defaults = cls()
    assert config_errors(defaults) == []
    floats = [f.name for f in dataclasses.fields(cls) if isinstance(getattr(defaults, f.name), float)]
    for name in floats:
        for bad in NON_FINITE:
            with pytest.raises(ConfigValueError) as info:
                cls(**{name: bad})
            assert (name, f"must be a finite number, got {bad}") in info.value.errors


def test_one_construction_reports_every_error() -> None:
    with pytest.raises(ConfigValueError) as info:
        AffinityConfig(epsilon=0, block_bytes=8, index_blocks=100, index_max_blocks=10)
    assert [name for name, _ in info.value.errors] == ["epsilon", "block_bytes", "index_max_blocks"]


def test_a_cross_field_rule_about_a_broken_field_is_left_out() -> None:
    with pytest.raises(ConfigValueError) as info:
        RetryConfig(backoff_base_ms=-1, backoff_max_ms=0)
    assert info.value.errors == [("backoff_base_ms", "must be >= 0, got -1")]


def test_backends_and_run_time_weights_share_the_bound() -> None:
    for bad in (*NON_FINITE, -1.0):
        with pytest.raises(ValueError, match="weight"):
            BackendSpec("a", "http://a", weight=bad)
        with pytest.raises(ValueError, match="weight"):
            BackendState(BackendSpec("a", "http://a"), weight=bad)
    snap = Snapshot.initial([BackendSpec("a", "http://a")])
    with pytest.raises(ValueError, match="weight"):
        snap.replace_backend("a", weight=1e308 * 10)
    zero = snap.replace_backend("a", weight=0.0).get("a")
    assert zero is not None and zero.effective_weight == 0.0
    with pytest.raises(ValueError, match="max_inflight"):
        BackendSpec("a", "http://a", max_inflight=0)


def test_config_sections_are_all_covered() -> None:
    # A section added to Config must be in SECTIONS, so that the test above checks it too. GrpcOptions
    # (proxy/grpc/grpc_config.py) is checked by the parser only, not yet when built in code.
    from proxy.grpc.grpc_config import GrpcOptions

    # dict: `models` (aliases: ModelAliasConfig entries, strings only, checked when built).
    nested = {type(f.default) if f.default is not dataclasses.MISSING else type(f.default_factory())  # type: ignore[misc]  # a field without a default has a default_factory here
              for f in dataclasses.fields(Config)}
    unchecked = nested - set(SECTIONS) - {bool, tuple, dict, type(None), GrpcOptions}
    assert not unchecked, unchecked
