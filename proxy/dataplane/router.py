"""The data-plane-neutral routing step: summary -> pick -> in-flight accounting -> metrics.

Every data plane (HTTP/1.1 and the HTTP/2 bridge through proxy/dataplane/openai.py, gRPC in
proxy/grpc/call.py) does exactly this around each upstream exchange:

    async with router.route(summary, received_at=t0) as lease:   # UnknownModel / NoBackendAvailable / Overloaded
        backend = lease.backend                     # BackendState chosen against one snapshot
        ...forward to backend.spec.url...
        lease.status = 200                          # what the client got; recorded when the block exits

`route()` picks at `__aenter__` (so a retry after a failure is just another `route(summary,
exclude=lease.tried)`; proxy/dataplane/retry.py), counts the request in the shared `InflightTable` for exactly as long as the block runs
(streams included, client disconnects included: cancellation exits the block too), and records the decision,
status and duration (from `received_at`, when the request's head arrived). Overload and retry policy
(RESILIENCE) plug in here so every protocol gets them.
"""

from __future__ import annotations

import time
from types import TracebackType
from typing import TYPE_CHECKING, Awaitable, Callable, Mapping

from proxy.control.store import SnapshotStore
from proxy.core.decision import Decision, NoBackendAvailable, Outcome, Policy, Reason
from proxy.core.overload import OverloadConfig, PanicView, may_saturate, saturated
from proxy.core.request import RequestSummary
from proxy.core.snapshot import BackendState, Snapshot
from proxy.core.inflight import InflightTable
from proxy.experiments.runtime import ArmRuntime, ExperimentRuntime
from proxy.metrics import ProxyMetrics

if TYPE_CHECKING:
    from proxy.dataplane.admission import AdmissionQueue


class UnknownModel(NoBackendAvailable):
    """No configured backend serves the requested model: a client error (404), not an outage."""


class Overloaded(NoBackendAvailable):
    """Every candidate is saturated (in-flight limit, engine queue or KV usage over `overload` thresholds),
    or the process is at `limits.max_inflight_total`. Answered with `status` and `Retry-After`."""

    def __init__(self, message: str, status: int = 503, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s


class _ModelIndex:
    """Per snapshot version: which backends cannot serve a model (to exclude) and which models exist."""

    __slots__ = ("version", "any_model", "known", "exclude", "no_grpc", "names", "holders", "adapters",
                 "adapter_names")

    def __init__(self, snapshot: Snapshot) -> None:
        self.version = snapshot.version
        self.no_grpc = frozenset(b.name for b in snapshot.backends if not b.spec.grpc_address)
        self.any_model = any(not b.spec.models for b in snapshot.backends)
        # A backend restricted to some models serves the LoRA adapters it has loaded too (declared ones are in
        # its `models` already; discovered ones only in its `adapters`).
        self.known = frozenset(m for b in snapshot.backends for m in (*b.spec.models, *b.adapters))
        self.exclude: dict[str, frozenset[str]] = {}
        # LoRA adapter -> the backends that have it loaded (declared or discovered); the adapter names are
        # what a request's `model` is matched against to set its summary's `adapter`.
        self.names = frozenset(b.name for b in snapshot.backends)
        holders: dict[str, set[str]] = {}
        for b in snapshot.backends:
            for a in b.adapters:
                holders.setdefault(a, set()).add(b.name)
        self.holders = {a: frozenset(n) for a, n in holders.items()}
        self.adapters = frozenset(holders)
        self.adapter_names: frozenset[str] | None = None  # with the router's catalog: `Router.adapter_names`

    def excluded_for(self, snapshot: Snapshot, model: str) -> frozenset[str]:
        ex = self.exclude.get(model)
        if ex is None:
            ex = self.exclude[model] = frozenset(
                b.name for b in snapshot.backends
                if not b.serves(model)
            )
        return ex


class Lease:
    """One routed attempt of one request, from the pick to the end of its upstream exchange.

    The one definition, for every protocol, of what a request counts for: it holds one in-flight slot
    (`InflightTable`, charged `tokens`) from the pick until `finish()`, and `finish()` records the
    backend, the HTTP `status` (gRPC: mapped to its HTTP equivalent; 499 = the client went away) and the
    duration since the request's head was received (`received_at`, time.monotonic), then reports the
    outcome for passive outlier detection. A coroutine data plane uses it as `async with`; a
    callback-driven one (gRPC) awaits what `prepare` answers, then calls `try_pick` / `wait_in_queue` and
    `finish` itself.
    """

    __slots__ = ("router", "summary", "exclude", "grpc", "decision", "backend", "status", "outcome",
                 "client_chosen", "tokens", "received_at", "_open", "arm", "first_byte_at", "body")

    def __init__(self, router: Router, summary: RequestSummary, exclude: frozenset[str],
                 received_at: float | None = None, grpc: bool = False) -> None:
        self.router = router
        self.summary = summary
        self.exclude = exclude
        self.grpc = grpc  # only backends with a gRPC address are eligible
        self.decision: Decision
        self.backend: BackendState
        self.status = 499
        # What went wrong with the backend, when the status alone cannot tell (connect failure, reset,
        # mid-stream break); None = judge by `status`. Feeds passive outlier detection.
        self.outcome: Outcome | None = None
        # The client chose this ending (its own deadline ran out): it says nothing about the backend.
        self.client_chosen = False
        self.tokens = summary.prompt_tokens_est + (summary.max_tokens or 0)  # tokens_of(summary), inlined
        self.received_at = time.monotonic() if received_at is None else received_at
        self._open = False
        # Experiments (proxy/experiments): the request's arm, and what its measurement needs from the data
        # plane: when the backend's response head arrived (time.monotonic) and a JSON answer's body (usage).
        self.arm: ArmRuntime | None = router.experiments.arm_for(summary) if router.experiments is not None else None
        self.first_byte_at: float | None = None
        self.body: bytes | None = None

    @property
    def tried(self) -> frozenset[str]:
        """Backends to exclude when retrying this request elsewhere."""
        return self.exclude | {self.decision.backend}

    def try_pick(self) -> None:
        """Pick now or raise (UnknownModel, Overloaded, NoBackendAvailable); on success the slot is held."""
        self._hold(*self._pick())

    async def wait_in_queue(self, first: Overloaded) -> None:
        """overload.action: queue -- wait (bounded) for capacity, then hold the slot; re-raises the
        overload answer when the queue is full or the wait is over."""
        queue = self.router.queue
        if queue is None or not queue.enabled:
            raise first
        self._hold(*await queue.wait_for(self._pick, first))

    def _pick(self) -> tuple[Decision, BackendState]:
        if self.arm is not None:
            return self.router.pick(self.summary, self.exclude, grpc=self.grpc, arm=self.arm)
        if self.grpc:
            return self.router.pick(self.summary, self.exclude, grpc=True)
        return self.router.pick(self.summary, self.exclude)

    def _hold(self, decision: Decision, backend: BackendState) -> None:
        self.decision = decision
        self.backend = backend
        self.router.inflight.acquire(decision.backend, self.tokens)
        self._open = True

    def finish(self) -> None:
        """Release the slot and record the attempt; safe to call more than once."""
        if not self._open:
            return
        self._open = False
        name = self.decision.backend
        router = self.router
        status = self.status
        router.inflight.release(name, self.tokens)
        elapsed = time.monotonic() - self.received_at
        router.metrics.finished(name, status, elapsed)
        if self.arm is not None:
            ttft = None if self.first_byte_at is None else self.first_byte_at - self.received_at
            self.arm.finished(status, self.outcome, elapsed, ttft, self.body)
        queue = router.queue
        if queue is not None and queue.waiters:
            queue.notify_one()  # capacity freed: wake one request waiting in the overload queue
        report = router.on_outcome
        if report is not None:
            outcome = self.outcome
            # 499: the client left; a client-chosen ending (its deadline): neither says anything of the backend
            if outcome is None and status != 499 and not self.client_chosen:
                outcome = Outcome.STATUS_5XX if status >= 500 else Outcome.SUCCESS
            if outcome is not None:
                report(name, outcome)

    def prepare(self) -> Awaitable[None] | None:
        """What to await before the first pick (the router's `prepare` hook: e.g. a long prompt's
        tokenisation for the precise lookup, bounded by the hook itself), or None: pick at once."""
        prepare = self.router.prepare
        return prepare(self.summary) if prepare is not None else None

    def enter(self) -> Awaitable[None] | None:
        """Pick, holding the slot: None when that is done already (the usual case: no coroutine made, no
        await), else an awaitable that does it (a prompt to prepare first, the overload queue). Raises what
        `try_pick` raises."""
        router = self.router
        prepare = router.prepare
        if prepare is not None:
            ready = prepare(self.summary)
            if ready is not None:  # short and cached prompts take no extra await
                return self._enter_after(ready)
        try:
            # try_pick(), spelled out for the usual attempt (no experiment arm, not gRPC)
            if self.arm is None and not self.grpc:
                decision, backend = router.pick(self.summary, self.exclude)
            else:
                decision, backend = self._pick()
        except Overloaded as exc:
            return self.wait_in_queue(exc)
        self.decision = decision
        self.backend = backend
        router.inflight.acquire(decision.backend, self.tokens)
        self._open = True
        return None

    async def _enter_after(self, ready: Awaitable[None]) -> None:
        await ready
        try:
            self.try_pick()
        except Overloaded as exc:
            await self.wait_in_queue(exc)

    async def __aenter__(self) -> Lease:
        waiting = self.enter()
        if waiting is not None:
            await waiting
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.finish()


def tokens_of(summary: RequestSummary) -> int:
    """What one request is charged in the in-flight table: its prompt estimate plus its output budget."""
    return summary.prompt_tokens_est + (summary.max_tokens or 0)


class Router:
    """admit -> pick for every protocol: one policy, one in-flight table, one set of overload rules.

    Everything it uses comes in here: the snapshot store, the policy, the in-flight table, the request
    metrics and RESILIENCE's pieces (saturation thresholds, panic routing, the overload queue, the passive
    outlier reports). A reload swaps policy and thresholds with `reconfigure`.
    """

    def __init__(
        self,
        store: SnapshotStore,
        policy: Policy,
        inflight: InflightTable,
        metrics: ProxyMetrics,
        max_inflight_total: int | None = None,
        *,
        overload: OverloadConfig | None = None,
        panic: PanicView | None = None,
        queue: AdmissionQueue | None = None,
        on_outcome: Callable[[str, Outcome], None] | None = None,
        experiments: ExperimentRuntime | None = None,
        aliases: Mapping[str, tuple[str, str | None]] | None = None,
        adapter_catalog: frozenset[str] = frozenset(),
        prepare: Callable[[RequestSummary], Awaitable[None] | None] | None = None,
    ) -> None:
        self.store = store
        # Public model name -> (served name, fallback): YAML `models` (see resolve_model).
        self.aliases: dict[str, tuple[str, str | None]] = dict(aliases or {})
        # Adapters the LoRA pool may load (proxy/control/lora_pool.py): requests for them are adapter
        # requests even where none has them loaded yet, and their demand is counted for the pool.
        self.adapter_catalog = adapter_catalog
        self._adapter_demand: dict[str, int] = {}
        self.policy = policy
        self.inflight = inflight
        self.metrics = metrics
        self.max_inflight_total = max_inflight_total
        self._models = _ModelIndex(store.current)
        # Defaults keep the plain behaviour (spec.max_inflight only, no queue, no panic routing).
        self.overload = overload if overload is not None else OverloadConfig()
        # Per (snapshot, overload config): the backends `saturated` could ever call saturated (an in-flight
        # limit, or fresh telemetry with a queue/KV threshold set); for the others it is False.
        self._limits_for: tuple[Snapshot, OverloadConfig] | None = None
        self._may_saturate: frozenset[str] = frozenset()
        self.panic = panic
        self.queue = queue
        self.on_outcome = on_outcome
        self.experiments = experiments  # live A/B arms and canary groups: each arm picks with its own policy
        # Awaited before a request's first pick when it answers an awaitable (None: pick at once), e.g.
        # `PreciseMatcher.prepare`: a long, uncached prompt waits (bounded) for its own tokenisation.
        self.prepare = prepare
        # Called before every pick when set: the KV-event subscriber's `drain` (telemetry.kv_events
        # .drain_interval_ms > 0), so the pick reads an index holding every event that has arrived.
        self.refresh: Callable[[], None] | None = None

    def reconfigure(self, *, policy: Policy | None = None, overload: OverloadConfig | None = None,
                    panic: PanicView | None = None) -> None:
        """A reload's data-plane half: the next picks use these."""
        if policy is not None:
            self.policy = policy
        if overload is not None:
            self.overload = overload
        if panic is not None:
            self.panic = panic

    def route(self, summary: RequestSummary, exclude: frozenset[str] = frozenset(), *,
              received_at: float | None = None, grpc: bool = False) -> Lease:
        return Lease(self, summary, exclude, received_at, grpc)

    def model_known(self, model: str | None, snapshot: Snapshot | None = None) -> bool:
        snapshot = snapshot or self.store.current
        index = self._index(snapshot)
        return model is None or index.any_model or model in index.known or not snapshot.backends

    def resolve_model(self, model: str) -> str:
        """The model to ask the backends for when a client asks for `model`: itself unless it is an alias;
        an alias's served model, or its fallback when no backend of the served model is routable now."""
        alias = self.aliases.get(model)
        if alias is None:
            return model
        served, fallback = alias
        if fallback is not None and not self._any_routable_for(served):
            return fallback
        return served

    def _any_routable_for(self, model: str) -> bool:
        snapshot = self.store.current
        if self.panic is not None:
            snapshot = self.panic(snapshot)
        return any(b.routable and b.serves(model) for b in snapshot.backends)

    def adapter_names(self) -> frozenset[str]:
        """The LoRA adapters loaded anywhere in the fleet now, and the pool's catalog (for
        `summary_from_openai(adapters=...)`)."""
        index = self._index(self.store.current)
        names = index.adapter_names
        if names is None:  # once per snapshot (the catalog is fixed for the router's life)
            loaded = index.adapters
            names = index.adapter_names = loaded | self.adapter_catalog if self.adapter_catalog else loaded
        return names

    def take_adapter_demand(self) -> dict[str, int]:
        """Requests per LoRA adapter routed since the last call (the adapter pool's input)."""
        demand, self._adapter_demand = self._adapter_demand, {}
        return demand

    def _index(self, snapshot: Snapshot) -> _ModelIndex:
        index = self._models
        if index.version != snapshot.version:
            index = self._models = _ModelIndex(snapshot)
        return index

    def pick(self, summary: RequestSummary, exclude: frozenset[str], grpc: bool = False,
             arm: ArmRuntime | None = None) -> tuple[Decision, BackendState]:
        """Choose a backend for `summary` against the current snapshot, honouring in-flight limits; with
        `grpc`, only among backends that have a gRPC address; with an experiment `arm`, with the arm's
        policy among the arm's backends."""
        if self.max_inflight_total is not None and self.inflight.total_requests >= self.max_inflight_total:
            self.metrics.error("overloaded")
            raise self._overloaded(f"the proxy is at its limit of {self.max_inflight_total} requests in flight")
        refresh = self.refresh
        if refresh is not None:
            refresh()
        snapshot = self.store.current
        if self.panic is not None:
            snapshot = self.panic(snapshot)  # too few healthy: the unhealthy ones count as routable again
        if grpc:
            no_grpc = self._index(snapshot).no_grpc
            if no_grpc:
                exclude = exclude | no_grpc
        model = summary.model
        if model is not None:
            index = self._index(snapshot)
            if not index.any_model:
                if model not in index.known and snapshot.backends:
                    self.metrics.error("unknown_model")
                    raise UnknownModel(f"The model '{model}' does not exist")
                excluded = index.excluded_for(snapshot, model)
                if excluded:
                    exclude = exclude | excluded
        if summary.adapter is not None:
            demand = self._adapter_demand
            demand[summary.adapter] = demand.get(summary.adapter, 0) + 1
            # An adapter is served where it is loaded; only when none of those can be tried does the
            # request go elsewhere (an engine that can load adapters at run time, or an adapter pool).
            index = self._index(snapshot)
            holders = index.holders.get(summary.adapter)
            if holders and not holders <= exclude:
                exclude = exclude | (index.names - holders)
        policy = self.policy
        if arm is not None:
            policy = arm.policy or policy
            exclude = exclude | arm.outside(snapshot)
        home = summary.state_home
        if home is not None and home not in exclude:
            # The engine there holds state the request refers to (a stored Responses API response): anywhere
            # else it is a sure 404, so it goes there while routable, whatever its load.
            state = snapshot.get(home)
            if state is not None and state.routable:
                decision = Decision(home, Reason.SESSION, policy.name)
                self.metrics.decision(decision.policy, decision.reason)
                return decision, state
        limits_for = self._limits_for
        overload = self.overload
        if limits_for is None or limits_for[0] is not snapshot or limits_for[1] is not overload:
            self._limits_for = (snapshot, overload)
            self._may_saturate = may_saturate(snapshot, overload)
        capped = self._may_saturate
        limited = False
        for _ in range(len(snapshot.backends) + 1):
            try:
                decision = policy.pick(summary, snapshot, self.inflight, exclude)
            except NoBackendAvailable as exc:
                if limited:
                    break
                self.metrics.error("no_backend")
                raise NoBackendAvailable(str(exc) or "no backend is available") from None
            backend = snapshot.get(decision.backend)
            if backend is None:
                raise RuntimeError(f"policy {policy.name} picked {decision.backend!r}, not in the snapshot")
            if decision.backend not in capped or not saturated(backend, self.inflight.get(backend.name), overload):
                self.metrics.decision(decision.policy, decision.reason)
                return decision, backend
            exclude = exclude | {backend.name}
            limited = True
        self.metrics.error("overloaded")
        raise self._overloaded("every backend that serves this request is saturated")

    def _overloaded(self, message: str) -> Overloaded:
        return Overloaded(message, self.overload.reject_status, self.overload.retry_after_s)
