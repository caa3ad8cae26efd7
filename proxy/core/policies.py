"""The load-balancing policies without prompt affinity, and `build_policy`, the one factory for all.

Every policy implements the `Policy` protocol of proxy/core/decision.py. Each is a small state machine
(a rotation position, smooth-WRR current weights, a seeded RNG) that one data-plane event loop drives;
none reads a clock or draws unseeded randomness, so a sequence of picks is reproducible in tests and in
the offline replay. Eligibility is the same for all: routable (healthy/unknown, weight > 0), not excluded
by the caller (a retry excludes the backends it already tried), and serving the requested model.

Alternates (for retries) are the other eligible backends in the order the policy itself would try them,
capped at `RoutingConfig.max_alternates` so a 256-backend fleet does not pay for a full sort per request.
"""

from __future__ import annotations

import abc
import heapq
import random
from typing import Any, Mapping, Sequence

from proxy.core.decision import Decision, Inflight, NoBackendAvailable, Policy, Reason
from proxy.core.load import assumed_score, effective_load
from proxy.core.request import RequestSummary
from proxy.core.routing_config import RoutingConfig
from proxy.core.snapshot import BackendState, Snapshot

_NO_INFLIGHT = Inflight()


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


def _stream_seed(seed: int, instance: int) -> int:
    """One reproducible random stream per policy instance.

    Worker processes that drew from the same stream would make the same "random" choices in lockstep and
    herd onto the same backends; an instance number (the worker index) separates them while every run of
    the same (seed, instance) stays reproducible. No randomness is involved in the affinity mapping.
    """
    return seed * 1_000_003 + instance


def _rotated(names: Sequence[str], start: int, limit: int) -> tuple[str, ...]:
    n = len(names)
    return tuple(names[(start + i) % n] for i in range(1, min(n, limit + 1)))


class RoundRobin:
    """Each eligible backend in turn, in configuration order."""

    name = "round_robin"

    def __init__(self, cfg: RoutingConfig = RoutingConfig()) -> None:
        self._max_alt = cfg.max_alternates
        self._pos = 0

    def pick(
        self,
        req: RequestSummary,
        snapshot: Snapshot,
        inflight: Mapping[str, Inflight],
        exclude: frozenset[str] = frozenset(),
    ) -> Decision:
        names = [b.name for b in eligible(req, snapshot, exclude)]
        i = self._pos % len(names)
        self._pos = (self._pos + 1) % (1 << 62)
        return Decision(names[i], Reason.BALANCED, self.name, _rotated(names, i, self._max_alt))


class WeightedRoundRobin:
    """nginx's smooth weighted round robin: weights 5,1,1 give a,a,b,a,c,a,a, not a,a,a,a,a,b,c.

    Each pick adds every eligible backend's weight to its current weight, takes the largest and subtracts
    the total from it. Ineligible backends keep their current weight (as in nginx) so a brief exclusion does
    not reset the sequence; backends gone from the snapshot are forgotten.
    """

    name = "weighted_round_robin"

    def __init__(self, cfg: RoutingConfig = RoutingConfig()) -> None:
        self._max_alt = cfg.max_alternates
        self._current: dict[str, float] = {}
        self._version = -1

    def pick(
        self,
        req: RequestSummary,
        snapshot: Snapshot,
        inflight: Mapping[str, Inflight],
        exclude: frozenset[str] = frozenset(),
    ) -> Decision:
        states = eligible(req, snapshot, exclude)
        current = self._current
        if snapshot.version != self._version:
            self._version = snapshot.version
            for gone in [n for n in current if n not in snapshot]:
                del current[gone]
        total = 0.0
        best: str | None = None
        best_w = 0.0
        for b in states:
            w = b.effective_weight
            total += w
            cw = current.get(b.name, 0.0) + w
            current[b.name] = cw
            if best is None or cw > best_w:
                best, best_w = b.name, cw
        assert best is not None
        current[best] = best_w - total
        alts = heapq.nlargest(
            self._max_alt, (b.name for b in states if b.name != best), key=lambda n: current[n]
        )
        return Decision(best, Reason.BALANCED, self.name, tuple(alts))


class _LeastLoaded(abc.ABC):
    """Shared by the "fewest of something per unit of weight" policies: rank, then break ties by a
    rotating start, so that an idle fleet is used evenly instead of the first backend taking every request
    that arrives between completions. Subclasses only say what load is (`_loads`)."""

    name: str

    def __init__(self, cfg: RoutingConfig = RoutingConfig()) -> None:
        self._cfg = cfg
        self._rot = 0

    @abc.abstractmethod
    def _loads(self, states: list[BackendState], snapshot: Snapshot,
               inflight: Mapping[str, Inflight]) -> list[float]:
        """Each eligible backend's load per unit of weight, in the order of `states`."""

    def pick(
        self,
        req: RequestSummary,
        snapshot: Snapshot,
        inflight: Mapping[str, Inflight],
        exclude: frozenset[str] = frozenset(),
    ) -> Decision:
        states = eligible(req, snapshot, exclude)
        n = len(states)
        start = self._rot % n
        self._rot = (self._rot + 1) % (1 << 62)
        loads = self._loads(states, snapshot, inflight)
        keyed = [(load, (i - start) % n, b.name) for i, (b, load) in enumerate(zip(states, loads))]
        ranked = heapq.nsmallest(1 + self._cfg.max_alternates, keyed)
        return Decision(ranked[0][2], Reason.BALANCED, self.name, tuple(k[2] for k in ranked[1:]))


class LeastRequest(_LeastLoaded):
    """Fewest in-flight requests (the proxy's own, always fresh) per unit of weight; ties rotate."""

    name = "least_request"

    def _loads(self, states: list[BackendState], snapshot: Snapshot,
               inflight: Mapping[str, Inflight]) -> list[float]:
        return [inflight.get(b.name, _NO_INFLIGHT).requests / b.effective_weight for b in states]


class RandomPolicy:
    """Weighted random choice from a seeded generator: reproducible, and the same in every worker."""

    name = "random"

    def __init__(self, cfg: RoutingConfig = RoutingConfig(), instance: int = 0) -> None:
        self._max_alt = cfg.max_alternates
        self._rng = random.Random(_stream_seed(cfg.seed, instance))

    def pick(
        self,
        req: RequestSummary,
        snapshot: Snapshot,
        inflight: Mapping[str, Inflight],
        exclude: frozenset[str] = frozenset(),
    ) -> Decision:
        states = eligible(req, snapshot, exclude)
        order: list[str] = []
        pool = list(states)
        for _ in range(min(len(pool), 1 + self._max_alt)):
            total = sum(b.effective_weight for b in pool)
            x = self._rng.random() * total
            k = len(pool) - 1
            for j, b in enumerate(pool):
                x -= b.effective_weight
                if x < 0:
                    k = j
                    break
            order.append(pool.pop(k).name)
        return Decision(order[0], Reason.BALANCED, self.name, tuple(order[1:]))


class PowerOfTwo:
    """Power of two choices: two distinct random backends, the less loaded (per weight) wins.

    Load is `effective_load` (telemetry + in-flight), so P2C works with or without telemetry. With one
    eligible backend there is nothing to compare.
    """

    name = "power_of_two"

    def __init__(self, cfg: RoutingConfig = RoutingConfig(), instance: int = 0) -> None:
        self._cfg = cfg
        self._rng = random.Random(_stream_seed(cfg.seed, instance))

    def pick(
        self,
        req: RequestSummary,
        snapshot: Snapshot,
        inflight: Mapping[str, Inflight],
        exclude: frozenset[str] = frozenset(),
    ) -> Decision:
        states = eligible(req, snapshot, exclude)
        n = len(states)
        if n == 1:
            return Decision(states[0].name, Reason.BALANCED, self.name)
        i, j = self._rng.sample(range(n), 2)
        a, b = states[i], states[j]
        assumed = assumed_score(snapshot.backends, self._cfg.load)
        la = effective_load(a, inflight.get(a.name), self._cfg.load, assumed=assumed) / a.effective_weight
        lb = effective_load(b, inflight.get(b.name), self._cfg.load, assumed=assumed) / b.effective_weight
        win, lose = (a, b) if la <= lb else (b, a)
        rest = [s.name for s in states if s is not win and s is not lose]
        alts = ((lose.name,) + tuple(rest))[: self._cfg.max_alternates]
        return Decision(win.name, Reason.BALANCED, self.name, alts)


class LeastLoad(_LeastLoaded):
    """Lowest `effective_load` per unit of weight: telemetry score when fresh, plus in-flight work.

    Stale backends are ranked at the fleet's assumed score plus what the proxy knows it sent them, never as
    idle. Ties rotate, as in least_request.
    """

    name = "least_load"

    def _loads(self, states: list[BackendState], snapshot: Snapshot,
               inflight: Mapping[str, Inflight]) -> list[float]:
        load_cfg = self._cfg.load
        assumed = assumed_score(snapshot.backends, load_cfg)
        return [
            effective_load(b, inflight.get(b.name), load_cfg, assumed=assumed) / b.effective_weight
            for b in states
        ]


def build_policy(cfg: RoutingConfig, *, instance: int = 0, precise: Any = None) -> Policy:
    """The policy named by `cfg.policy`, configured by `cfg`. A fresh instance each call (its own state).

    `instance` (e.g. the worker process index) gives `random` and `power_of_two` their own seeded
    stream per worker; it has no effect on the other policies, and none on the affinity mapping, which
    is the same in every worker and replica by design. `precise` (affinity only): the KV-event lookup,
    `proxy.core.affinity.PreciseLookup`.
    """
    if cfg.policy == "affinity":
        from proxy.core.affinity import AffinityPolicy

        return AffinityPolicy(cfg, precise=precise)
    if cfg.policy == RandomPolicy.name:
        return RandomPolicy(cfg, instance)
    if cfg.policy == PowerOfTwo.name:
        return PowerOfTwo(cfg, instance)
    factories = {
        RoundRobin.name: RoundRobin,
        WeightedRoundRobin.name: WeightedRoundRobin,
        LeastRequest.name: LeastRequest,
        LeastLoad.name: LeastLoad,
    }
    factory = factories.get(cfg.policy)
    if factory is None:
        raise ValueError(f"policy: unknown policy {cfg.policy!r}")
    return factory(cfg)
