"""The experiment runtime: assigns requests to arms, measures the arms, runs the guardrails.

One per process, built by proxy/app.py and handed to the Router (proxy/dataplane/router.py):

    arm = experiments.arm_for(summary)        # None: the request is in no experiment
    policy = arm.policy or router.policy      # the arm's own policy object (its learned state)
    exclude |= arm.outside(snapshot)          # canary groups: only the arm's backends
    ...
    arm.finished(status, outcome, e2e_s, ttft_s, body)     # from Lease.finish()

Every `evaluate_every_s` the evaluator reads each arm's sliding window (proxy/experiments/window.py) or,
for `source: prometheus` rules, an instant PromQL query, and applies the pure `evaluate` of
proxy/core/experiments.py. Each action is a log line, a metric (`affinity_proxy_experiment_actions_total`)
and an entry in the experiment's history (`GET /admin/experiments`).

With --workers N each worker process runs its own runtime over its own share of the traffic: assignment
is the same in every worker (and every replica), and so are the weights as long as no rule fires; the
weights a `source: proxy` rule sets follow each worker's own window, so use `source: prometheus` rules for
one fleet-wide judgement across workers and replicas (they all read the same Prometheus).

A request can be pinned to an arm for debugging with the `pin_header` (`experiment/arm` or `arm`);
with an admin token configured it must also carry the token in `pin_token_header`.
"""

from __future__ import annotations

import asyncio
import contextvars
import hmac
import logging
import math
import time
from collections import deque
from typing import Any, Callable, Iterable, Mapping

import aiohttp
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from proxy.aio import cancel_and_wait
from proxy.core.decision import Outcome, Policy
from proxy.core.experiments import (
    Action, ArmConfig, ArmWindow, ExperimentConfig, ExperimentsConfig, ExperimentState, assign, assignment_key,
    assignment_point, carry_state, evaluate, experiment_seed, readings_from_windows,
)
from proxy.core.request import RequestSummary
from proxy.core.routing_config import RoutingConfig
from proxy.core.snapshot import Snapshot
from proxy.experiments.window import EXPORT_BOUNDS, ArmStats, usage_of, window_json

log = logging.getLogger("affinity_proxy.experiments")

# The arm a request was pinned to by its pin header; set per request task by `pin_request`.
_PINNED: contextvars.ContextVar[ArmRuntime | None] = contextvars.ContextVar("affinity_pinned_arm", default=None)
HISTORY_LEN = 500
TIMELINE_LEN = 2000


class ArmRuntime:
    """One arm: its policy object (None: the router's), its backend group, its measurements."""

    __slots__ = ("experiment", "name", "config", "policy", "stats", "clock", "_claimed", "_outside", "_version")

    def __init__(self, experiment: str, config: ArmConfig, policy: Policy | None, claimed_by_others: frozenset[str],
                 window_s: float, clock: Callable[[], float]) -> None:
        self.experiment = experiment
        self.name = config.name
        self.config = config
        self.policy = policy
        self.stats = ArmStats(window_s)
        self.clock = clock
        self._claimed = claimed_by_others
        self._outside: frozenset[str] = frozenset()
        self._version = -1

    @property
    def policy_name(self) -> str | None:
        return self.policy.name if self.policy is not None else None

    def outside(self, snapshot: Snapshot) -> frozenset[str]:
        """The backends of `snapshot` this arm must not use (cached per snapshot version)."""
        if snapshot.version != self._version:
            group = self.config.backends
            if group:
                self._outside = frozenset(b.name for b in snapshot.backends if b.name not in group)
            else:
                self._outside = frozenset(b.name for b in snapshot.backends if b.name in self._claimed)
            self._version = snapshot.version
        return self._outside

    def finished(self, status: int, outcome: Outcome | None, e2e_s: float, ttft_s: float | None,
                 body: bytes | None) -> None:
        """One finished attempt of a request in this arm."""
        self.stats.observe(self.clock(), status, outcome, e2e_s, ttft_s, usage_of(body))


class _Experiment:
    __slots__ = ("config", "seed", "arms", "state", "history", "timeline", "actions")

    def __init__(self, config: ExperimentConfig, arms: dict[str, ArmRuntime], state: ExperimentState) -> None:
        self.config = config
        self.seed = experiment_seed(config.name)
        self.arms = arms
        self.state = state
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY_LEN)
        self.timeline: deque[dict[str, Any]] = deque(maxlen=TIMELINE_LEN)
        self.actions: dict[tuple[str, str], int] = {}

    def weight_of(self, arm: str) -> float:
        if self.state.promoted is not None:
            return 1.0 if arm == self.state.promoted else 0.0
        if arm == self.config.control:
            return max(0.0, 1.0 - sum(s.weight for s in self.state.arms.values()))
        s = self.state.arms.get(arm)
        return s.weight if s is not None else 0.0


class ExperimentRuntime:
    def __init__(self, cfg: ExperimentsConfig, *, build_policy: Callable[[RoutingConfig], Policy],
                 admin_token: str | None = None, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time, routes: bool = True) -> None:
        """`routes`: False in a --workers supervisor, which holds the definitions but routes nothing."""
        self._build_policy = build_policy
        self.routes = routes
        self.admin_token = admin_token
        self.clock = clock
        self.wall_clock = wall_clock
        self.cfg = ExperimentsConfig()
        self._experiments: list[_Experiment] = []
        self._by_arm: dict[str, ArmRuntime] = {}
        self._pin_header: bytes | None = None
        self._token_header = b""
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self.query_errors = 0
        self.reconfigure(cfg)

    # ------------------------------------------------------------------------------------------ config

    @property
    def active(self) -> bool:
        return bool(self._experiments)

    def reconfigure(self, cfg: ExperimentsConfig) -> None:
        """Swap in a new `experiments:` section. An arm whose settings (routing, group) did not change keeps
        its policy object, its measurements and its learned weight."""
        old = {e.config.name: e for e in self._experiments}
        experiments: list[_Experiment] = []
        for ecfg in cfg.definitions:
            prev = old.get(ecfg.name)
            arms: dict[str, ArmRuntime] = {}
            for arm_cfg in ecfg.arms:
                claimed = frozenset(b for a in ecfg.arms if a.name != arm_cfg.name for b in a.backends)
                kept = prev.arms.get(arm_cfg.name) if prev is not None else None
                if kept is not None and kept.config == arm_cfg and kept._claimed == claimed:
                    kept.stats.resize(cfg.window_s)
                    arms[arm_cfg.name] = kept
                    continue
                policy = self._build_policy(arm_cfg.routing) if arm_cfg.routing is not None else None
                arms[arm_cfg.name] = ArmRuntime(ecfg.name, arm_cfg, policy, claimed, cfg.window_s, self.clock)
            state = carry_state(prev.config if prev else None, prev.state if prev else None, ecfg)
            exp = _Experiment(ecfg, arms, state)
            if prev is not None:
                exp.history, exp.timeline, exp.actions = prev.history, prev.timeline, prev.actions
            experiments.append(exp)
        self.cfg = cfg
        self._experiments = experiments
        self._by_arm = {}
        for exp in experiments:
            for arm in exp.arms.values():
                self._by_arm[f"{exp.config.name}/{arm.name}"] = arm
                self._by_arm.setdefault(arm.name, arm)
        self._pin_header = cfg.pin_header.lower().encode() if cfg.pin_header else None
        self._token_header = cfg.pin_token_header.lower().encode()
        if self._task is not None:
            self._task.cancel()  # the interval may have changed; start() semantics again
            self._task = asyncio.get_running_loop().create_task(self._run(), name="experiments")

    # ------------------------------------------------------------------------------------------ hot path

    def arm_for(self, summary: RequestSummary) -> ArmRuntime | None:
        """The arm of a request, or None when it is in no experiment."""
        if not self._experiments:
            return None
        pinned = _PINNED.get()
        if pinned is not None:
            return pinned
        key: bytes | None = None
        for exp in self._experiments:
            cfg = exp.config
            if cfg.model is not None and summary.model != cfg.model:
                continue
            if key is None:
                key = assignment_key(summary)
            state = exp.state
            name = assign(cfg, state.weights(), assignment_point(key, exp.seed), state.promoted)
            return exp.arms[name]
        return None

    def pin_request(self, raw_headers: Iterable[tuple[bytes, bytes]]) -> tuple[int, str] | None:
        """Read the pin header of one request (call it in the request's own task). Returns (status, message)
        of the answer to give instead when the pin is refused, None otherwise."""
        want = self._pin_header
        if want is None or not self._experiments:
            return None
        value: bytes | None = None
        token: bytes | None = None
        for name, v in raw_headers:
            lname = name.lower()
            if lname == want:
                value = v
            elif lname == self._token_header:
                token = v
        if value is None:
            _PINNED.set(None)
            return None
        if self.admin_token is not None and (token is None or not hmac.compare_digest(token, self.admin_token.encode())):
            return 403, f"pinning an arm with {self.cfg.pin_header} needs the admin token in {self.cfg.pin_token_header}"
        arm = self._by_arm.get(value.decode("latin-1").strip())
        if arm is None:
            return 400, f"{self.cfg.pin_header}: no arm {value.decode('latin-1')!r} (write experiment/arm or arm)"
        _PINNED.set(arm)
        return None

    # ------------------------------------------------------------------------------------------ evaluator

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="experiments")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.evaluate_every_s)
            try:
                await self.evaluate_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("experiment evaluation failed")

    async def evaluate_once(self) -> list[Action]:
        """One guardrail pass over every experiment; the actions taken."""
        now = self.clock()
        taken: list[Action] = []
        for exp in list(self._experiments):
            cfg = exp.config
            windows = {name: arm.stats.window(now) for name, arm in exp.arms.items()}
            readings: dict[int, dict[str, float | None]] = dict(readings_from_windows(cfg, windows))
            prom = [(i, r) for i, r in enumerate(cfg.guardrails) if r.source == "prometheus"]
            if prom:
                for i, rule in prom:
                    assert rule.prometheus_url is not None and rule.query is not None
                    names = list(exp.arms)
                    values = await asyncio.gather(*(
                        self.query(rule.prometheus_url, rule.query.replace("{arm}", n).replace("{experiment}", cfg.name))
                        for n in names))
                    readings[i] = dict(zip(names, values, strict=True))
            if exp is not self._find(cfg.name):
                continue  # reloaded while querying
            exp.state, actions = evaluate(cfg, exp.state, readings, now)
            for action in actions:
                self._record(exp, action)
            taken.extend(actions)
            exp.timeline.append({
                "t": round(now, 3), "time": self.wall_clock(),
                "arms": {name: {"weight": round(exp.weight_of(name), 6), **window_json(windows[name]),
                                **{f"rule{i}": readings[i].get(name) for i in readings}}
                         for name in exp.arms},
            })
        return taken

    def _find(self, name: str) -> _Experiment | None:
        return next((e for e in self._experiments if e.config.name == name), None)

    def _record(self, exp: _Experiment, action: Action) -> None:
        key = (action.arm, action.kind)
        exp.actions[key] = exp.actions.get(key, 0) + 1
        entry = action.as_json()
        entry["time"] = self.wall_clock()
        exp.history.append(entry)
        log.warning("experiment %s: %s arm %s weight %.4f -> %.4f: %s", action.experiment, action.kind, action.arm,
                    action.old_weight, action.new_weight, "; ".join(action.reasons))

    async def query(self, url: str, promql: str) -> float | None:
        """One instant PromQL query; its first sample's value, None when empty, NaN or failed."""
        if self._session is None:
            self._session = aiohttp.ClientSession()
        try:
            async with self._session.get(url.rstrip("/") + "/api/v1/query", params={"query": promql},
                                         timeout=aiohttp.ClientTimeout(total=max(1.0, self.cfg.evaluate_every_s))) as resp:
                data = await resp.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            self.query_errors += 1
            log.warning("prometheus query failed (%s): %r", url, exc)
            return None
        try:
            result = data["data"]["result"]
            if not result:
                return None
            sample = result if data["data"].get("resultType") == "scalar" else result[0]["value"]
            value = float(sample[1])
        except (KeyError, IndexError, TypeError, ValueError):
            self.query_errors += 1
            log.warning("prometheus query %r: unexpected answer %.200r", promql, data)
            return None
        return None if math.isnan(value) or math.isinf(value) else value

    # ------------------------------------------------------------------------------------------ views

    def windows(self, experiment: str) -> Mapping[str, ArmWindow]:
        exp = self._find(experiment)
        if exp is None:
            raise KeyError(experiment)
        now = self.clock()
        return {name: arm.stats.window(now) for name, arm in exp.arms.items()}

    def weights(self, experiment: str) -> dict[str, float]:
        exp = self._find(experiment)
        if exp is None:
            raise KeyError(experiment)
        return {name: exp.weight_of(name) for name in exp.arms}

    def arm(self, experiment: str, arm: str) -> ArmRuntime:
        return self._by_arm[f"{experiment}/{arm}"]

    def as_json(self, timeline: bool = False) -> dict[str, Any]:
        now = self.clock()
        out: list[dict[str, Any]] = []
        for exp in self._experiments:
            cfg = exp.config
            arms = []
            for name, arm in exp.arms.items():
                arms.append({
                    "name": name, "control": name == cfg.control, "share": cfg.share_of(name),
                    "weight": round(exp.weight_of(name), 6), "policy": arm.policy_name or "(routing)",
                    "backends": list(arm.config.backends), "window": window_json(arm.stats.window(now)),
                    "totals": arm.stats.totals_json(),
                })
            item: dict[str, Any] = {
                "name": cfg.name, "model": cfg.model, "control": cfg.control, "promoted": exp.state.promoted,
                "guardrails": [{"when": g.when, "factor": g.factor, "source": g.source, "query": g.query}
                               for g in cfg.guardrails],
                "arms": arms, "history": list(exp.history),
            }
            if timeline:
                item["timeline"] = list(exp.timeline)
            out.append(item)
        note = {} if self.routes else {"note": "this process routes no requests (the --workers supervisor): the "
                                                "per-arm series of every worker are merged in /metrics"}
        return {**note, "evaluate_every_s": self.cfg.evaluate_every_s, "window_s": self.cfg.window_s,
                "pin_header": self.cfg.pin_header, "prometheus_query_errors": self.query_errors, "experiments": out}

    def collect(self) -> Iterable[Metric]:
        """The per-arm Prometheus series (registered as a scrape-time collector)."""
        labels = ["experiment", "arm"]
        req = CounterMetricFamily("affinity_proxy_experiment_requests", "Attempts routed in each experiment arm.", labels=labels)
        err = CounterMetricFamily("affinity_proxy_experiment_errors", "Failed attempts per arm, by kind (5xx, "
                                  "connect_failure, reset, stream_failure).", labels=[*labels, "kind"])
        prompt = CounterMetricFamily("affinity_proxy_experiment_prompt_tokens", "Prompt tokens per arm, from the "
                                     "backends' usage.", labels=labels)
        cached = CounterMetricFamily("affinity_proxy_experiment_cached_tokens", "Prompt tokens served from prefix "
                                     "cache per arm (usage.prompt_tokens_details.cached_tokens).", labels=labels)
        ttft = HistogramMetricFamily("affinity_proxy_experiment_ttft_seconds", "Time to the backend's response head "
                                     "(streams: the first token) per arm, successful attempts.", labels=labels)
        e2e = HistogramMetricFamily("affinity_proxy_experiment_duration_seconds", "Arrival to end of response per arm.",
                                    labels=labels)
        weight = GaugeMetricFamily("affinity_proxy_experiment_weight", "Current traffic share of each arm.", labels=labels)
        acts = CounterMetricFamily("affinity_proxy_experiment_actions", "Guardrail actions per arm (cut, restore, "
                                   "promote).", labels=[*labels, "action"])
        for exp in self._experiments:
            e = exp.config.name
            for name, arm in exp.arms.items():
                s = arm.stats
                req.add_metric([e, name], s.requests)
                for kind, n in s.errors.items():
                    err.add_metric([e, name, kind], n)
                prompt.add_metric([e, name], s.prompt_tokens)
                cached.add_metric([e, name], s.cached_tokens)
                ttft.add_metric([e, name], _cumulative(s.ttft_counts), s.ttft_sum)
                e2e.add_metric([e, name], _cumulative(s.e2e_counts), s.e2e_sum)
                weight.add_metric([e, name], exp.weight_of(name))
            for (arm_name, kind), n in exp.actions.items():
                acts.add_metric([e, arm_name, kind], n)
        return (req, err, prompt, cached, ttft, e2e, weight, acts)


def _cumulative(counts: list[int]) -> list[tuple[str, float]]:
    out: list[tuple[str, float]] = []
    running = 0
    for bound, n in zip((*EXPORT_BOUNDS, math.inf), counts, strict=True):
        running += n
        out.append(("+Inf" if bound == math.inf else repr(float(bound)), running))
    return out
