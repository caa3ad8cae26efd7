"""Sessions everywhere: every policy sends a session to its rendezvous home, under the bounded-load cap."""

from __future__ import annotations

from collections import Counter

import httpx
import pytest

from proxy.core.decision import Inflight, Reason
from proxy.core.registry import POLICIES, build_policy
from proxy.core.routing_config import AffinityConfig, RoutingConfig
from proxy.core.request import RequestSummary
from sim.fleet import Fleet
from tests.core.helpers import fleet as make_fleet
from tests.routing.conftest import ProxyFactory, model_of


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_keeps_a_session_on_its_home(policy: str) -> None:
    snap = make_fleet(4)
    homes: dict[str, set[str]] = {}
    policies = [build_policy(RoutingConfig(policy=policy), instance=i) for i in range(2)]  # two workers agree
    for round_ in range(5):
        for user in range(12):
            req = RequestSummary(prompt=f"turn {round_} of a different question {user * round_}",
                                 session_key=f"user-{user}")
            for p in policies:
                d = p.pick(req, snap, {})
                assert d.reason is Reason.SESSION
                homes.setdefault(req.session_key or "", set()).add(d.backend)
    assert all(len(h) == 1 for h in homes.values()), homes
    assert len({next(iter(h)) for h in homes.values()}) >= 3  # sessions spread over the fleet


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_session_home_over_its_bound_sheds_the_request(policy: str) -> None:
    snap = make_fleet(4)
    p = build_policy(RoutingConfig(policy=policy))
    req = RequestSummary(prompt="x", session_key="heavy-user")
    home = p.pick(req, snap, {}).backend
    # 9 in flight on the home, none elsewhere: cap = ceil(2.5 * 10 / 4) = 7 < 10, so it must go elsewhere.
    d = p.pick(req, snap, {home: Inflight(requests=9)})
    assert d.backend != home


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_sessions_off_leaves_the_policy_its_own_rule(policy: str) -> None:
    cfg = RoutingConfig(policy=policy, affinity=AffinityConfig(session_affinity=False))
    p = build_policy(cfg)
    d = p.pick(RequestSummary(prompt="x", session_key="s"), make_fleet(4), {})
    assert d.reason is not Reason.SESSION


async def test_least_request_keeps_a_session_on_one_backend_through_the_proxy(
        fleet: Fleet, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(policy="least_request")
    homes: dict[str, set[str]] = {}
    async with httpx.AsyncClient(base_url=proxy.http_url, timeout=10) as c:
        for i in range(5):
            for user in range(8):
                resp = await c.post("/v1/completions", headers={"x-session-id": f"user-{user}"},
                                    json={"model": model_of(fleet), "prompt": f"prompt {i} {user}", "max_tokens": 1})
                assert resp.status_code == 200, resp.text
                homes.setdefault(f"user-{user}", set()).add(resp.headers["x-affinity-backend"])
        assert all(len(h) == 1 for h in homes.values()), homes
        # ... while requests without a session are still balanced by least request
        seen = Counter()
        for i in range(8):
            resp = await c.post("/v1/completions", json={"model": model_of(fleet), "prompt": f"p{i}", "max_tokens": 1})
            seen[resp.headers["x-affinity-backend"]] += 1
        assert len(seen) == len(fleet.servers)


def test_a_session_has_the_same_home_under_every_policy() -> None:
    snap = make_fleet(5)
    for user in range(20):
        req = RequestSummary(prompt="hello", session_key=f"user-{user}")
        homes = {build_policy(RoutingConfig(policy=name)).pick(req, snap, {}).backend for name in POLICIES}
        assert len(homes) == 1, (user, homes)
