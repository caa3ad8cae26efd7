"""The one table of routing policies: name -> factory. Adding a policy is its module plus one entry here.

The YAML `routing.policy` is checked against this table (proxy/config.py), `build_policy` builds from it,
and the tests take their list of policies from it, so no second list of names exists to forget.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Callable, Mapping

from proxy.core.affinity import AffinityPolicy, PeerLoad, PreciseLookup
from proxy.core.decision import Policy
from proxy.core.policies import (LeastCost, LeastLoad, LeastRequest, PowerOfTwo, RandomPolicy, RoundRobin,
                                 WeightedRoundRobin)
from proxy.core.routing_config import RoutingConfig
from proxy.core.work_ledger import WorkLedger

__all__ = ["POLICIES", "PolicyFactory", "PolicyInputs", "build_policy", "policy_name_error"]

@dataclass(frozen=True)
class PolicyInputs:
    """What a policy may be built with besides its config. `instance` (e.g. the worker process index) gives
    the policies that draw random numbers their own seeded stream per worker; the others ignore it, and so
    does the affinity mapping, which is the same in every worker and replica by design. `precise` is the
    KV-event lookup (proxy/control/kv_events.py), None without telemetry.kv_events; `work` the work ledger
    shared by a host's workers; `peers` the other replicas' load (routing.peer_load,
    proxy/control/peer_load.py). Only the policies that read a cache view or a load ledger take them."""

    instance: int = 0
    precise: PreciseLookup | None = None
    work: WorkLedger | None = None
    peers: PeerLoad | None = None


# (routing config, inputs) -> a fresh policy with its own state.
PolicyFactory = Callable[[RoutingConfig, PolicyInputs], Policy]

POLICIES: Mapping[str, PolicyFactory] = {
    AffinityPolicy.name: lambda cfg, i: AffinityPolicy(cfg, precise=i.precise, work=i.work, peers=i.peers),
    RoundRobin.name: lambda cfg, i: RoundRobin(cfg),
    WeightedRoundRobin.name: lambda cfg, i: WeightedRoundRobin(cfg),
    LeastRequest.name: lambda cfg, i: LeastRequest(cfg),
    RandomPolicy.name: lambda cfg, i: RandomPolicy(cfg, i.instance),
    PowerOfTwo.name: lambda cfg, i: PowerOfTwo(cfg, i.instance),
    LeastLoad.name: lambda cfg, i: LeastLoad(cfg),
    LeastCost.name: lambda cfg, i: LeastCost(cfg),
}


def policy_name_error(name: str) -> str | None:
    """Why `name` is not a policy (with a did-you-mean), or None when it is one."""
    if name in POLICIES:
        return None
    close = difflib.get_close_matches(name, list(POLICIES), n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"must be one of {', '.join(POLICIES)}, not {name!r}{hint}"


def build_policy(cfg: RoutingConfig, *, instance: int = 0, precise: PreciseLookup | None = None,
                 work: WorkLedger | None = None, peers: PeerLoad | None = None) -> Policy:
    """The policy named by `cfg.policy`, configured by `cfg`, built with the inputs it reads (`PolicyInputs`).
    A fresh instance each call (its own state)."""
    factory = POLICIES.get(cfg.policy)
    if factory is None:
        raise ValueError(f"policy: {policy_name_error(cfg.policy)}")
    return factory(cfg, PolicyInputs(instance, precise, work, peers))
