"""The load-balancing policies without affinity, and the factory."""

from __future__ import annotations

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.decision import Inflight, NoBackendAvailable, Reason
from proxy.core.policies import (
    LeastLoad,
    LeastRequest,
    PowerOfTwo,
    RandomPolicy,
    RoundRobin,
    WeightedRoundRobin,
)
from proxy.core.registry import POLICIES, build_policy
from proxy.core.routing_config import RoutingConfig
from proxy.core.snapshot import BackendSpec, Health, Snapshot

from .helpers import Ledger, fleet, fresh, prompt, with_state

REQ = prompt("hello")


def picks(policy, snap, n, inflight=None, exclude=frozenset()):
    return [policy.pick(REQ, snap, inflight or {}, exclude).backend for _ in range(n)]


def test_build_policy_covers_every_name():
    assert "affinity" in POLICIES and "round_robin" in POLICIES
    for name in POLICIES:
        policy = build_policy(RoutingConfig(policy=name))
        assert policy.name == name
        d = policy.pick(REQ, fleet(3), {})
        assert d.policy == name
        assert d.backend in {"gpu-0", "gpu-1", "gpu-2"}


def test_round_robin_cycles_in_config_order_and_skips_ineligible():
    snap = fleet(3)
    assert picks(RoundRobin(), snap, 6) == ["gpu-0", "gpu-1", "gpu-2"] * 2
    sick = with_state(snap, "gpu-1", health=Health.UNHEALTHY)
    assert set(picks(RoundRobin(), sick, 6)) == {"gpu-0", "gpu-2"}
    assert set(picks(RoundRobin(), snap, 6, exclude=frozenset({"gpu-0"}))) == {"gpu-1", "gpu-2"}


def test_round_robin_decides_balanced():
    d = RoundRobin().pick(REQ, fleet(4), {})
    assert d.backend == "gpu-0" and d.reason is Reason.BALANCED and d.policy == "round_robin"


def test_smooth_wrr_matches_nginx_sequence():
    snap = fleet(3, weights=[5, 1, 1])
    got = picks(WeightedRoundRobin(), snap, 7)
    assert got == ["gpu-0", "gpu-0", "gpu-1", "gpu-0", "gpu-2", "gpu-0", "gpu-0"]


@given(st.lists(st.integers(min_value=1, max_value=9), min_size=1, max_size=6))
@settings(max_examples=60, deadline=None)
def test_smooth_wrr_gives_exact_shares_per_cycle(weights):
    snap = fleet(len(weights), weights=weights)
    counts = collections.Counter(picks(WeightedRoundRobin(), snap, sum(weights) * 3))
    assert [counts[f"gpu-{i}"] for i in range(len(weights))] == [3 * w for w in weights]


def test_smooth_wrr_uses_runtime_weight_override():
    snap = with_state(fleet(2), "gpu-1", weight=3.0)
    counts = collections.Counter(picks(WeightedRoundRobin(), snap, 8))
    assert counts == {"gpu-0": 2, "gpu-1": 6}


def test_least_request_follows_inflight_and_spreads_ties():
    snap = fleet(3)
    inflight = {"gpu-0": Inflight(requests=5), "gpu-1": Inflight(requests=1), "gpu-2": Inflight(requests=2)}
    policy = LeastRequest()
    assert policy.pick(REQ, snap, inflight).backend == "gpu-1"
    # A retry excludes what it tried and gets the least loaded of the rest.
    assert policy.pick(REQ, snap, inflight, frozenset({"gpu-1"})).backend == "gpu-2"
    # An idle fleet: ties rotate instead of piling on the first backend.
    assert set(picks(LeastRequest(), snap, 3)) == {"gpu-0", "gpu-1", "gpu-2"}


def test_least_request_balances_with_feedback():
    snap = fleet(4)
    policy, ledger = LeastRequest(), Ledger()
    for _ in range(40):
        ledger.start(policy.pick(REQ, snap, ledger.inflight))
    assert {ledger.requests(n) for n in snap.names} == {10}


def test_least_request_is_per_weight():
    snap = fleet(2, weights=[3, 1])
    policy, ledger = LeastRequest(), Ledger()
    for _ in range(40):
        ledger.start(policy.pick(REQ, snap, ledger.inflight))
    assert (ledger.requests("gpu-0"), ledger.requests("gpu-1")) == (30, 10)


def test_random_is_seeded_reproducible_and_weighted():
    snap = fleet(3, weights=[2, 1, 1])
    a = picks(RandomPolicy(RoutingConfig(seed=7)), snap, 200)
    b = picks(RandomPolicy(RoutingConfig(seed=7)), snap, 200)
    c = picks(RandomPolicy(RoutingConfig(seed=8)), snap, 200)
    assert a == b and a != c
    counts = collections.Counter(picks(RandomPolicy(), snap, 4000))
    assert 1800 < counts["gpu-0"] < 2200


def test_seeded_streams_differ_per_instance_and_repeat_per_seed():
    snap = fleet(8)
    for name in ("random", "power_of_two"):
        cfg = RoutingConfig(policy=name, seed=5)
        w0 = picks(build_policy(cfg, instance=0), snap, 100)
        assert picks(build_policy(cfg, instance=0), snap, 100) == w0
        assert picks(build_policy(cfg, instance=1), snap, 100) != w0


def test_power_of_two_prefers_the_less_loaded_of_its_two():
    snap = fleet(2)
    inflight = {"gpu-0": Inflight(requests=30)}
    assert set(picks(PowerOfTwo(), snap, 20, inflight)) == {"gpu-1"}
    scored = fresh(snap, {"gpu-0": 0.1, "gpu-1": 0.9})
    assert set(picks(PowerOfTwo(), scored, 20)) == {"gpu-0"}


def test_power_of_two_keeps_the_worst_backend_out_of_a_balanced_fleet():
    snap = fleet(8)
    inflight = {"gpu-3": Inflight(requests=60)}
    got = picks(PowerOfTwo(RoutingConfig(seed=3)), snap, 400, inflight)
    assert "gpu-3" not in got
    d = PowerOfTwo().pick(REQ, fleet(1), {})
    assert d.backend == "gpu-0"


def test_least_load_uses_fresh_scores_plus_inflight():
    snap = fresh(fleet(3), {"gpu-0": 0.6, "gpu-1": 0.2, "gpu-2": 0.3})
    assert LeastLoad().pick(REQ, snap, {}).backend == "gpu-1"
    # 32 in-flight requests add 0.5 (of 64 = full): gpu-1 is now the most loaded.
    busy = {"gpu-1": Inflight(requests=32)}
    assert LeastLoad().pick(REQ, snap, busy).backend == "gpu-2"
    assert LeastLoad().pick(REQ, snap, busy, frozenset({"gpu-2"})).backend == "gpu-0"  # 0.6 < 0.2 + 0.5


def test_least_load_never_reads_stale_telemetry_as_idle():
    snap = fresh(fleet(3), {"gpu-0": 0.3, "gpu-1": 0.35})
    # gpu-2 has no telemetry at all and a stale one would be the same: assumed >= stale_score (0.5).
    assert set(picks(LeastLoad(), snap, 10)) <= {"gpu-0", "gpu-1"}
    stale = snap.replace_backend("gpu-0", stale=True)  # score 0.3 no longer trusted
    assert LeastLoad().pick(REQ, stale, {}).backend == "gpu-1"
    # A stale backend still counts the work the proxy knows it sent there.
    all_stale = fleet(2)
    assert LeastLoad().pick(REQ, all_stale, {"gpu-0": Inflight(requests=3)}).backend == "gpu-1"


def test_least_load_balances_a_stale_fleet_by_inflight():
    snap = fleet(4)
    policy, ledger = LeastLoad(), Ledger()
    for _ in range(20):
        ledger.start(policy.pick(REQ, snap, ledger.inflight))
    assert {ledger.requests(n) for n in snap.names} == {5}


@pytest.mark.parametrize("name", POLICIES)
def test_no_backend_available(name):
    policy = build_policy(RoutingConfig(policy=name))
    snap = fleet(2)
    with pytest.raises(NoBackendAvailable):
        policy.pick(REQ, snap, {}, frozenset(snap.names))
    drained = with_state(with_state(snap, "gpu-0", health=Health.DRAINING), "gpu-1", weight=0.0)
    with pytest.raises(NoBackendAvailable):
        policy.pick(REQ, drained, {})


@pytest.mark.parametrize("name", POLICIES)
def test_model_filter_holds_for_first_choice_and_retry(name):
    snap = Snapshot.initial(
        [
            BackendSpec("a", "http://a", models=("llama",)),
            BackendSpec("b", "http://b", models=("qwen",)),
            BackendSpec("c", "http://c"),
            BackendSpec("d", "http://d", models=("llama", "qwen")),
        ]
    )
    policy = build_policy(RoutingConfig(policy=name))
    for _ in range(12):
        d = policy.pick(prompt("x" * 600, model="qwen"), snap, {})
        assert d.backend in {"b", "c", "d"}
        retry = policy.pick(prompt("x" * 600, model="qwen"), snap, {}, frozenset({d.backend}))
        assert retry.backend in {"b", "c", "d"} - {d.backend}
    only_llama = Snapshot.initial([BackendSpec("a", "http://a", models=("llama",))])
    with pytest.raises(NoBackendAvailable, match="model"):
        policy.pick(prompt("x", model="qwen"), only_llama, {})


def test_every_policy_retries_elsewhere_until_the_fleet_is_exhausted():
    # What a retry does (proxy/dataplane/retry.py): ask again, excluding every backend already tried.
    snap = fleet(4)
    for name in POLICIES:
        policy, tried = build_policy(RoutingConfig(policy=name)), frozenset[str]()
        for _ in range(4):
            d = policy.pick(REQ, snap, {}, tried)
            assert d.backend not in tried, name
            tried |= {d.backend}
        with pytest.raises(NoBackendAvailable):
            policy.pick(REQ, snap, {}, tried)


@pytest.mark.parametrize("name", [n for n in POLICIES if n != "affinity"])
def test_one_policy_follows_each_new_snapshot_and_model(name):
    # A policy keeps each snapshot's eligible backends per model (nothing excluded): a later snapshot, a
    # retry's exclusion or another model must each see their own set, never the one kept before.
    policy = build_policy(RoutingConfig(policy=name))
    snap = Snapshot.initial([BackendSpec("a", "http://a", models=("llama",)), BackendSpec("b", "http://b"),
                             BackendSpec("c", "http://c")])
    llama, qwen = prompt("x", model="llama"), prompt("x", model="qwen")
    for _ in range(6):
        assert policy.pick(llama, snap, {}).backend in {"a", "b", "c"}
        assert policy.pick(qwen, snap, {}).backend in {"b", "c"}
        assert policy.pick(llama, snap, {}, frozenset({"a", "b"})).backend == "c"
    sick = with_state(snap, "b", health=Health.UNHEALTHY)
    for _ in range(6):
        assert policy.pick(llama, sick, {}).backend in {"a", "c"}
        assert policy.pick(qwen, sick, {}).backend == "c"
    gone = with_state(sick, "c", weight=0.0)
    with pytest.raises(NoBackendAvailable):
        policy.pick(qwen, gone, {})
    assert policy.pick(llama, gone, {}).backend == "a"
    back = with_state(gone, "b", health=Health.HEALTHY)
    assert {policy.pick(qwen, back, {}).backend for _ in range(6)} == {"b"}
    d1, d2 = policy.pick(llama, back, {}), policy.pick(llama, back, {})
    assert d1.reason is Reason.BALANCED and d1.policy == name and d2.reason is Reason.BALANCED
