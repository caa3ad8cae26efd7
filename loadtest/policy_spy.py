"""Watch a proxy's routing decisions from outside: wrap its policy object, not the router.

The router and the policies may be compiled (proxy/native): a compiled object's methods cannot be replaced,
so a measurement or a test that wants every pick puts a `PolicySpy` in the router's place of the policy
(`Router.reconfigure(policy=...)`, as a reload does). The spy forwards everything to the real policy and
calls `on_pick(summary, decision, inflight_before)` after each pick; `inflight_before` is the in-flight
requests per backend the policy read (this request's slot not taken yet).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from proxy.core.decision import Decision, Inflight, Policy
from proxy.core.request import RequestSummary
from proxy.core.snapshot import Snapshot

OnPick = Callable[[RequestSummary, Decision, dict[str, int]], None]


class PolicySpy:
    def __init__(self, policy: Policy, on_pick: OnPick) -> None:
        self.policy = policy
        self.on_pick = on_pick

    @property
    def name(self) -> str:
        return self.policy.name

    def pick(self, req: RequestSummary, snapshot: Snapshot, inflight: Mapping[str, Inflight],
             exclude: frozenset[str] = frozenset()) -> Decision:
        before = {name: i.requests for name, i in inflight.items()}
        decision = self.policy.pick(req, snapshot, inflight, exclude)
        self.on_pick(req, decision, before)
        return decision

    def __getattr__(self, name: str) -> Any:  # anything else a policy has (learned state, admin views)
        return getattr(self.policy, name)


def spy_on_policy(router: Any, on_pick: OnPick) -> PolicySpy:
    """Put a spy on `router`'s own policy (proxy.dataplane.router.Router); returns it."""
    spy = PolicySpy(router.policy, on_pick)
    router.reconfigure(policy=spy)
    return spy
