"""The load-balancing policies without prompt affinity (proxy/core/registry.py names and builds them all).

Every policy implements the `Policy` protocol of proxy/core/decision.py. Each is a small state machine
(a rotation position, smooth-WRR current weights, a seeded RNG) that one data-plane event loop drives;
none reads a clock or draws unseeded randomness, so a sequence of picks is reproducible in tests and in
the offline replay. Eligibility is the same for all (proxy/core/eligibility.py). A retry asks the policy
again with the backends already tried excluded (proxy/dataplane/retry.py), so its choice is made on the
load of that moment, not on a list of alternates drawn up before the first attempt.

Every policy here honours the session key the same way, in one step (`SessionFirst.pick`): the eligible
backends, then `eligibility.session_home`: a request with a session key goes to the key's rendezvous home
under the bounded in-flight cap (reason SESSION), and only a request without one (or one whose every
candidate is at its cap) is placed by the policy's own rule (`_place`, reason BALANCED). `affinity` places
sessions by the same hashing in proxy/core/affinity.py.
"""

from __future__ import annotations

import abc
import random
from typing import ClassVar, Mapping

from proxy.core.decision import Decision, Inflight, Reason
from proxy.core.eligibility import NO_INFLIGHT, eligible, session_home, stream_seed
from proxy.core.load import assumed_score, effective_load
from proxy.core.request import RequestSummary
from proxy.core.routing_config import RoutingConfig
from proxy.core.score import ScoreConfig, request_cost_s
from proxy.core.snapshot import BackendState, Snapshot


class SessionFirst(abc.ABC):
    """The step every policy of this module shares: eligibility, then the session key's home; the policy
    itself only says where a request that no session placed goes (`_place`)."""

    name: ClassVar[str]

    def __init__(self, cfg: RoutingConfig = RoutingConfig()) -> None:
        self._cfg = cfg
        # Per snapshot (immutable, so its eligible backends for a model never change): model -> the
        # eligible backends when nothing is excluded (the usual first attempt), and backend -> its
        # BALANCED decision (an immutable value), so a pick builds neither list nor Decision.
        self._for: Snapshot | None = None
        self._eligible: dict[str | None, list[BackendState]] = {}
        self._balanced: dict[str, Decision] = {}

    def pick(
        self,
        req: RequestSummary,
        snapshot: Snapshot,
        inflight: Mapping[str, Inflight],
        exclude: frozenset[str] = frozenset(),
    ) -> Decision:
        if snapshot is not self._for:
            self._for = snapshot
            self._eligible = {}
            self._balanced = {}
        if exclude:
            states = eligible(req, snapshot, exclude)
        else:
            cached = self._eligible.get(req.model)
            if cached is None:
                cached = eligible(req, snapshot, exclude)  # raises NoBackendAvailable when none
                if len(self._eligible) >= 1024:  # model names come from clients: keep the cache bounded
                    self._eligible.clear()
                self._eligible[req.model] = cached
            states = cached
        if req.session_key is not None:
            home = session_home(req, states, inflight, self._cfg)
            if home is not None:
                return Decision(home, Reason.SESSION, self.name)
        name = self._place(req, states, snapshot, inflight)
        decision = self._balanced.get(name)
        if decision is None:
            decision = self._balanced[name] = Decision(name, Reason.BALANCED, self.name)
        return decision

    @abc.abstractmethod
    def _place(self, req: RequestSummary, states: list[BackendState], snapshot: Snapshot,
               inflight: Mapping[str, Inflight]) -> str:
        """The backend this policy's own rule picks among `states` (eligible, never empty; read it, never
        change it: the list is kept for the snapshot's later picks)."""


class RoundRobin(SessionFirst):
    """Each eligible backend in turn, in configuration order."""

    name: ClassVar[str] = "round_robin"

    def __init__(self, cfg: RoutingConfig = RoutingConfig()) -> None:
        super().__init__(cfg)
        self._pos = 0

    def _place(self, req: RequestSummary, states: list[BackendState], snapshot: Snapshot,
               inflight: Mapping[str, Inflight]) -> str:
        i = self._pos % len(states)
        self._pos = (self._pos + 1) % (1 << 62)
        return states[i].spec.name


class WeightedRoundRobin(SessionFirst):
    """nginx's smooth weighted round robin: weights 5,1,1 give a,a,b,a,c,a,a, not a,a,a,a,a,b,c.

    Each pick adds every eligible backend's weight to its current weight, takes the largest and subtracts
    the total from it. Ineligible backends keep their current weight (as in nginx) so a brief exclusion does
    not reset the sequence; backends gone from the snapshot are forgotten.
    """

    name: ClassVar[str] = "weighted_round_robin"

    def __init__(self, cfg: RoutingConfig = RoutingConfig()) -> None:
        super().__init__(cfg)
        self._current: dict[str, float] = {}
        self._version = -1

    def _place(self, req: RequestSummary, states: list[BackendState], snapshot: Snapshot,
               inflight: Mapping[str, Inflight]) -> str:
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
        return best


class _LeastLoaded(SessionFirst):
    """Shared by the "fewest of something per unit of weight" policies: rank, then break ties by a
    rotating start, so that an idle fleet is used evenly instead of the first backend taking every request
    that arrives between completions. Subclasses only say what load is (`_loads`)."""

    def __init__(self, cfg: RoutingConfig = RoutingConfig()) -> None:
        super().__init__(cfg)
        self._rot = 0

    @abc.abstractmethod
    def _loads(self, states: list[BackendState], snapshot: Snapshot,
               inflight: Mapping[str, Inflight]) -> list[float]:
        """Each eligible backend's load per unit of weight, in the order of `states`."""

    def _place(self, req: RequestSummary, states: list[BackendState], snapshot: Snapshot,
               inflight: Mapping[str, Inflight]) -> str:
        n = len(states)
        start = self._rot % n
        self._rot = (self._rot + 1) % (1 << 62)
        loads = self._loads(states, snapshot, inflight)
        best = min((load, (i - start) % n, b.name) for i, (b, load) in enumerate(zip(states, loads)))
        return best[2]


class LeastRequest(_LeastLoaded):
    """Fewest in-flight requests (the proxy's own, always fresh) per unit of weight; ties rotate."""

    name: ClassVar[str] = "least_request"

    def _loads(self, states: list[BackendState], snapshot: Snapshot,
               inflight: Mapping[str, Inflight]) -> list[float]:
        return [inflight.get(b.name, NO_INFLIGHT).requests / b.effective_weight for b in states]


class RandomPolicy(SessionFirst):
    """Weighted random choice from a seeded generator: reproducible, and the same in every worker."""

    name: ClassVar[str] = "random"

    def __init__(self, cfg: RoutingConfig = RoutingConfig(), instance: int = 0) -> None:
        super().__init__(cfg)
        self._rng = random.Random(stream_seed(cfg.seed, instance))

    def _place(self, req: RequestSummary, states: list[BackendState], snapshot: Snapshot,
               inflight: Mapping[str, Inflight]) -> str:
        x = self._rng.random() * sum(b.effective_weight for b in states)
        chosen = states[-1]
        for b in states:
            x -= b.effective_weight
            if x < 0:
                chosen = b
                break
        return chosen.name


class PowerOfTwo(SessionFirst):
    """Power of two choices: two distinct random backends, the less loaded (per weight) wins.

    Load is `effective_load` (telemetry + in-flight), so P2C works with or without telemetry. With one
    eligible backend there is nothing to compare.
    """

    name: ClassVar[str] = "power_of_two"

    def __init__(self, cfg: RoutingConfig = RoutingConfig(), instance: int = 0) -> None:
        super().__init__(cfg)
        self._rng = random.Random(stream_seed(cfg.seed, instance))

    def _place(self, req: RequestSummary, states: list[BackendState], snapshot: Snapshot,
               inflight: Mapping[str, Inflight]) -> str:
        n = len(states)
        if n == 1:
            return states[0].name
        i, j = self._rng.sample(range(n), 2)
        a, b = states[i], states[j]
        assumed = assumed_score(snapshot.backends, self._cfg.load)
        la = effective_load(a, inflight.get(a.name), self._cfg.load, assumed=assumed) / a.effective_weight
        lb = effective_load(b, inflight.get(b.name), self._cfg.load, assumed=assumed) / b.effective_weight
        return (a if la <= lb else b).name


class LeastLoad(_LeastLoaded):
    """Lowest `effective_load` per unit of weight: telemetry score when fresh, plus in-flight work.

    Stale backends are ranked at the fleet's assumed score plus what the proxy knows it sent them, never as
    idle. Ties rotate, as in least_request.
    """

    name: ClassVar[str] = "least_load"

    def _loads(self, states: list[BackendState], snapshot: Snapshot,
               inflight: Mapping[str, Inflight]) -> list[float]:
        load_cfg = self._cfg.load
        assumed = assumed_score(snapshot.backends, load_cfg)
        return [
            effective_load(b, inflight.get(b.name), load_cfg, assumed=assumed) / b.effective_weight
            for b in states
        ]


class LeastCost(SessionFirst):
    """The design's request-aware score: the backend where THIS request is estimated to finish soonest.

    Per candidate, `score.request_cost_s` with the request's own prompt length and `max_tokens`: the
    backend's waiting queue, the prompt's prefill, and `max_tokens` decode steps slowed by the batch it
    joins over its life: the proxy's in-flight requests there, each counted by how long it overlaps this
    one (from their estimated tokens), plus whatever else telemetry reports running; per unit of weight.
    So a 2,048-token generation goes where the batch holds short requests that will soon leave, rather than
    long ones, while short requests see every in-flight request as their batch (least request). The engine constants (prefill rate, ITL, slowdown per sequence) are `ScoreConfig`'s. A request
    without `max_tokens` is priced at `reference_max_tokens`. Ties rotate, as in least_request.
    """

    name: ClassVar[str] = "least_cost"

    def __init__(self, cfg: RoutingConfig = RoutingConfig(), score: ScoreConfig = ScoreConfig()) -> None:
        super().__init__(cfg)
        self._score = score
        self._rot = 0

    def _place(self, req: RequestSummary, states: list[BackendState], snapshot: Snapshot,
               inflight: Mapping[str, Inflight]) -> str:
        n = len(states)
        start = self._rot % n
        self._rot = (self._rot + 1) % (1 << 62)
        score = self._score
        max_tokens = req.max_tokens if req.max_tokens is not None else score.reference_max_tokens
        prompt_tokens = req.prompt_tokens_est
        costs = []
        for i, b in enumerate(states):
            mine = inflight.get(b.name, NO_INFLIGHT)
            cost = request_cost_s(prompt_tokens, max_tokens, None if b.stale else b.signals, score,
                                  mine.requests, mine.tokens)
            costs.append((cost / b.effective_weight, (i - start) % n, b.name))
        best = min(costs)
        return best[2]
