"""Which backends a request may go to, and the helpers every policy shares (pure, deterministic).

Eligibility is the same for all policies: routable (healthy/unknown, weight > 0), not excluded by the
caller (a retry excludes the backends it already tried), and serving the requested model.
"""

from __future__ import annotations

from proxy.core.decision import Inflight, NoBackendAvailable
from proxy.core.request import RequestSummary
from proxy.core.snapshot import BackendState, Snapshot

NO_INFLIGHT = Inflight()


def eligible(req: RequestSummary, snapshot: Snapshot, exclude: frozenset[str]) -> list[BackendState]:
    """The backends a request may go to, in configuration order; raises NoBackendAvailable if none."""
    model = req.model
    out = [
        b
        for b in snapshot.backends
        if b.routable
        and b.name not in exclude
        and (model is None or not b.spec.models or model in b.spec.models)
    ]
    if not out:
        if model is not None and not any(
            not b.spec.models or model in b.spec.models for b in snapshot.backends
        ):
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
