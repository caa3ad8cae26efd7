"""The one table of routing policies: name -> factory. Adding a policy is its module plus one entry here.

The YAML `routing.policy` is checked against this table (proxy/config.py), `build_policy` builds from it,
and the tests take their list of policies from it, so no second list of names exists to forget.
"""

from __future__ import annotations

import difflib
from typing import Callable, Mapping

from proxy.core.affinity import AffinityPolicy, PeerLoad, PreciseLookup
from proxy.core.decision import Policy
from proxy.core.policies import (LeastCost, LeastLoad, LeastRequest, PowerOfTwo, RandomPolicy, RoundRobin,
                                 WeightedRoundRobin)
from proxy.core.routing_config import RoutingConfig
from proxy.core.work_ledger import WorkLedger

__all__ = ["POLICIES", "PolicyFactory", "build_policy", "policy_name_error"]

# (routing config, instance, precise) -> a fresh policy with its own state. `instance` (e.g. the worker
# process index) gives the policies that draw random numbers their own seeded stream per worker; the others
# ignore it, and so does the affinity mapping, which is the same in every worker and replica by design.
# `precise` is the KV-event lookup (proxy/control/kv_events.py), None without telemetry.kv_events; only the
# policies that read a cache view take it.
PolicyFactory = Callable[[RoutingConfig, int, "PreciseLookup | None"], Policy]

POLICIES: Mapping[str, PolicyFactory] = {
    AffinityPolicy.name: lambda cfg, instance, precise: AffinityPolicy(cfg, precise=precise),
    RoundRobin.name: lambda cfg, instance, precise: RoundRobin(cfg),
    WeightedRoundRobin.name: lambda cfg, instance, precise: WeightedRoundRobin(cfg),
    LeastRequest.name: lambda cfg, instance, precise: LeastRequest(cfg),
    RandomPolicy.name: lambda cfg, instance, precise: RandomPolicy(cfg, instance),
    PowerOfTwo.name: lambda cfg, instance, precise: PowerOfTwo(cfg, instance),
    LeastLoad.name: lambda cfg, instance, precise: LeastLoad(cfg),
    LeastCost.name: lambda cfg, instance, precise: LeastCost(cfg),
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
    """The policy named by `cfg.policy`, configured by `cfg`. A fresh instance each call (its own state).
    `work` and `peers` (the affinity policy's work ledger, and the other replicas' load from
    routing.peer_load, proxy/control/peer_load.py) go to the affinity policy; the others ignore them."""
    factory = POLICIES.get(cfg.policy)
    if factory is None:
        raise ValueError(f"policy: {policy_name_error(cfg.policy)}")
    if cfg.policy == AffinityPolicy.name and (work is not None or peers is not None):
        return AffinityPolicy(cfg, precise=precise, work=work, peers=peers)
    return factory(cfg, instance, precise)
