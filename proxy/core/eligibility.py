"""Which backends a request may go to, and the helpers every policy shares (pure, deterministic).

Eligibility is the same for all policies: routable (healthy/unknown, weight > 0), not excluded by the
caller (a retry excludes the backends it already tried), and serving the requested model.

Sessions are the same for all policies too (`session_home`): a request carrying a session key goes to the
key's rendezvous home among the eligible backends, under the affinity policy's in-flight bound.
"""

from __future__ import annotations

import math
from typing import Mapping

import xxhash

from proxy.core.decision import Inflight, NoBackendAvailable
from proxy.core.request import RequestSummary
from proxy.core.routing_config import RoutingConfig
from proxy.core.snapshot import BackendState, Snapshot

_xxh3 = xxhash.xxh3_64_intdigest
# The same domains as proxy/core/affinity.py's session placement, so a session has the same home under
# every policy (affinity ranks all backends serving the model; its home, when eligible, is this one).
_SESSION_DOMAIN = b"affinity-proxy/session/v1\xff"
_BACKEND_DOMAIN = b"affinity-proxy/backend/v1\xff"
_TWO_POW_M64 = 2.0**-64

NO_INFLIGHT = Inflight()


def eligible(req: RequestSummary, snapshot: Snapshot, exclude: frozenset[str]) -> list[BackendState]:
    """The backends a request may go to, in configuration order; raises NoBackendAvailable if none."""
    model = req.model
    out = [
        b
        for b in snapshot.backends
        if b.routable
        and b.name not in exclude
        and b.serves(model)
    ]
    if not out:
        if model is not None and not any(b.serves(model) for b in snapshot.backends):
            raise NoBackendAvailable(f"no backend serves model {model!r}")
        raise NoBackendAvailable("no routable backend" + (f" outside {sorted(exclude)}" if exclude else ""))
    return out


def stream_seed(seed: int, instance: int) -> int:
    """One reproducible random stream per policy instance.

    Worker processes that drew from the same stream would make the same "random" choices in lockstep and
    herd onto the same backends; an instance number (the worker index) separates them while every run of
    the same (seed, instance) stays reproducible. No randomness is involved in the affinity mapping.
    """
    return seed * 1_000_003 + instance


def session_home(req: RequestSummary, states: list[BackendState], inflight: Mapping[str, Inflight],
                 cfg: RoutingConfig) -> str | None:
    """Where a session goes: the first backend in the rendezvous order of its key (weighted, as affinity
    ranks) whose in-flight requests + 1 stay within ceil((1 + request_epsilon) * (fleet in-flight + 1) *
    weight / total weight), the bounded-load cap of proxy/core/affinity.py. None when the request has no
    session key, sessions are off (`affinity.session_affinity`), or every eligible backend is at its cap
    (then the policy places it by its own rule)."""
    key = req.session_key
    if key is None or not cfg.affinity.session_affinity or not states:
        return None
    kb = _xxh3(_SESSION_DOMAIN + key.encode("utf-8", "surrogatepass")).to_bytes(8, "little")
    weights = [b.effective_weight for b in states]
    seeds = [_xxh3(_BACKEND_DOMAIN + b.name.encode("utf-8", "surrogatepass")) for b in states]
    if len(set(weights)) <= 1:
        scores = [float(_xxh3(kb, s)) for s in seeds]
    else:
        scores = [w / -math.log((_xxh3(kb, s) + 0.5) * _TWO_POW_M64) for s, w in zip(seeds, weights)]
    counts = [inflight.get(b.name, NO_INFLIGHT).requests for b in states]
    total_w = sum(weights)
    fleet = sum(counts) + 1
    factor = 1.0 + cfg.affinity.request_epsilon
    for i in sorted(range(len(states)), key=lambda i: scores[i], reverse=True):
        if counts[i] + 1 <= math.ceil(factor * fleet * weights[i] / total_w):
            return states[i].name
    return None
