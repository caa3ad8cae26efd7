"""Live experiments: A/B arms of routing policies or canary backend groups, sticky assignment, guardrails.

Pure: plain data in, decisions out. No clock (`now` is passed in), no I/O; the runtime that measures the
arms, runs the evaluator every few seconds and queries Prometheus lives in proxy/experiments/.

**Definitions.** An experiment has a control arm and one or more candidate arms. Each arm is either a
routing policy with its own settings (`routing:`, a `RoutingConfig` built through proxy/core/registry.py's
table; none = the proxy's own `routing:` policy object) or a canary backend group (`backends:`, the only
backends the arm may use), or both. An arm without `backends` uses every backend that no other arm of the
experiment claims, so `stable` + `canary: {backends: [gpu-7, gpu-8]}` keeps the canary build away from the
stable traffic and vice versa. `model:` limits an experiment to the requests for one model.

**Assignment** is sticky and deterministic. The key of a request is its session key (the configured
session header), else its conversation's distinguishing prefix (`RequestSummary.key_prefix_chars`: the
chat prompt through the first user turn, which every later turn of the conversation repeats; see
proxy/core/fingerprint.py), else the whole prompt. xxh3 of the key, seeded by the experiment's name, is
mapped to a point u in [0, 1); the same in every worker process and every replica (nothing is salted).

**Why a weight cut never moves a conversation INTO a candidate.** The hash space is laid out once, from
the configured shares: candidate i owns the fixed interval starting at base_i = the sum of the configured
shares of the candidates before it, and with current weight w_i <= share_i it takes the LOW slice
[base_i, base_i + w_i) of that interval. The control arm takes every point no candidate takes. Cutting w_i
shrinks the slice from its top: the points in [base_i + w_new, base_i + w_old) go to the control arm and no
point anywhere goes from the control arm (or another candidate) to arm i. So a conversation that started
on the stable group stays there through every cut. Only a restore (stepping w_i back up after a clean
window) or a promotion moves control points into a candidate, which is what ramping a canary back up means;
an experiment with `restore_factor` left unreachable (no clean window) never does.

**Guardrails** are rules per experiment, read over a sliding window of per-arm aggregates:

    error_rate > 0.02                      -> weight x 0.3
    ttft_p99 > 1.2 x control               -> weight x 0.5
    hit_ratio < control - 5 points         -> weight x 0.5

`evaluate(config, state, readings, counts, now)` returns the next state and the actions taken, each with
its reasons: cuts (weight x factor, never below `floor`, at most one per `cooldown_s`), restores (after
`restore_after_s` with no rule firing, weight x `restore_factor` up to the configured share) and, when
`auto_promote_after_s` is set, the promotion of a candidate that stayed clean at its full share that long
(it then takes all of the experiment's traffic). Readings come from the proxy's own per-arm aggregates
(`readings_from_windows`) or, for `source: prometheus` rules, from PromQL answers the runtime fetched.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Iterable, Literal, Mapping, Sequence

import xxhash

from proxy.core.bounds import check_config
from proxy.core.registry import policy_name_error
from proxy.core.request import RequestSummary
from proxy.core.routing_config import RoutingConfig

__all__ = [
    "PROXY_METRICS",
    "Action",
    "ArmConfig",
    "ArmState",
    "ArmWindow",
    "Condition",
    "ExperimentConfig",
    "ExperimentState",
    "ExperimentsConfig",
    "GuardrailConfig",
    "assign",
    "assignment_key",
    "assignment_point",
    "carry_state",
    "evaluate",
    "initial_state",
    "parse_condition",
    "readings_from_windows",
]

# What a `source: proxy` rule can read from the proxy's own per-arm window aggregates.
PROXY_METRICS = ("error_rate", "ttft_p99", "e2e_p99", "hit_ratio")

_xxh3 = xxhash.xxh3_64_intdigest
_ASSIGN_DOMAIN = b"affinity-proxy/experiment/v1\xff"
_TWO_64 = float(1 << 64)
# A restore from a weight of 0 (floor 0) needs somewhere to start.
MIN_RESTORE_WEIGHT = 0.01


# ---------------------------------------------------------------------------------------------- conditions


@dataclass(frozen=True, slots=True)
class Condition:
    """`metric op threshold`, the threshold absolute, `value x control` or `control +/- value points`."""

    metric: str
    op: Literal[">", "<"]
    kind: Literal["absolute", "ratio", "points"]
    value: float

    @property
    def relative(self) -> bool:
        return self.kind != "absolute"

    def threshold(self, control: float | None) -> float | None:
        """The bound the arm's reading is compared with; None when it needs a control reading and has none."""
        if self.kind == "absolute":
            return self.value
        if control is None:
            return None
        if self.kind == "ratio":
            return self.value * control
        return control + self.value / 100.0  # percentage points of a ratio

    def fires(self, reading: float | None, control: float | None) -> bool:
        bound = self.threshold(control)
        if reading is None or bound is None or math.isnan(reading):
            return False
        return reading > bound if self.op == ">" else reading < bound

    def __str__(self) -> str:
        if self.kind == "absolute":
            return f"{self.metric} {self.op} {self.value:g}"
        if self.kind == "ratio":
            return f"{self.metric} {self.op} {self.value:g} x control"
        sign = "+" if self.value >= 0 else "-"
        return f"{self.metric} {self.op} control {sign} {abs(self.value):g} points"


_NUM = r"[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?"
_COND = re.compile(
    rf"^\s*(?P<metric>[A-Za-z_][A-Za-z0-9_]*)\s*(?P<op>[<>])\s*(?:"
    rf"(?P<ratio>{_NUM})\s*(?:x|\*|×)\s*control"
    rf"|control\s*(?P<sign>[+-])\s*(?P<points>{_NUM})\s*(?:points?|pts?)"
    rf"|(?P<abs>{_NUM}))\s*$"
)


def parse_condition(text: str) -> Condition:
    """Parse `error_rate > 0.02`, `ttft_p99 > 1.2 x control`, `hit_ratio < control - 5 points`."""
    m = _COND.match(text)
    if m is None:
        raise ValueError(
            f"cannot read condition {text!r}; write `METRIC > 0.02`, `METRIC > 1.2 x control` "
            "or `METRIC < control - 5 points`"
        )
    op: Literal[">", "<"] = ">" if m["op"] == ">" else "<"
    if m["ratio"] is not None:
        return Condition(m["metric"], op, "ratio", float(m["ratio"]))
    if m["points"] is not None:
        points = float(m["points"])
        return Condition(m["metric"], op, "points", points if m["sign"] == "+" else -points)
    return Condition(m["metric"], op, "absolute", float(m["abs"]))


# ---------------------------------------------------------------------------------------------- config


@dataclass(frozen=True)
class GuardrailConfig:
    """One rule: `when` fires -> the candidate's weight x `factor`."""

    when: str = "error_rate > 0.02"
    factor: float = field(default=0.5, metadata={"gt": 0.0, "lt": 1.0})
    # A proxy-sourced reading over fewer requests than this in the window is not judged (too noisy).
    min_requests: int = field(default=20, metadata={"ge": 1})
    source: Literal["proxy", "prometheus"] = "proxy"
    # source: prometheus -- the server and an instant PromQL query giving one arm's value; `{arm}` and
    # `{experiment}` in the query are replaced by the arm's and the experiment's names.
    prometheus_url: str | None = None
    query: str | None = None

    def __post_init__(self) -> None:
        check_config(self)

    @property
    def condition(self) -> Condition:
        return parse_condition(self.when)

    def validate(self) -> Iterable[tuple[str, str]]:
        try:
            cond = parse_condition(self.when)
        except ValueError as exc:
            yield "when", str(exc)
            return
        if self.source == "proxy" and cond.metric not in PROXY_METRICS:
            yield "when", f"metric {cond.metric!r} is not one the proxy measures ({', '.join(PROXY_METRICS)}); " \
                          "use source: prometheus with a query for others"
        if self.source == "prometheus":
            if not self.prometheus_url:
                yield "prometheus_url", "is required with source: prometheus"
            elif not self.prometheus_url.startswith(("http://", "https://")):
                yield "prometheus_url", f"must be an http(s) URL, got {self.prometheus_url!r}"
            if not self.query:
                yield "query", "is required with source: prometheus"
            elif "{arm}" not in self.query:
                yield "query", "must contain {arm} (the arm whose value it gives)"
        elif self.query is not None or self.prometheus_url is not None:
            yield "query", "query and prometheus_url are only read with source: prometheus"


@dataclass(frozen=True)
class ArmConfig:
    name: str = ""
    # Share of the experiment's traffic, 0..1. Candidates must set it; the control arm takes the rest (leave
    # it out, or write exactly the rest).
    share: float | None = field(default=None, metadata={"ge": 0.0, "le": 1.0})
    # The arm's own routing policy and settings; None: the proxy's `routing:` policy (its learned state shared
    # with the traffic outside experiments).
    routing: RoutingConfig | None = None
    # A canary backend group: the arm routes only to these backends. Empty: every backend no other arm claims.
    backends: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_config(self)

    def validate(self) -> Iterable[tuple[str, str]]:
        if not re.fullmatch(r"[A-Za-z0-9_.:-]+", self.name):
            yield "name", f"must be a non-empty name of letters, digits and _.:- (a metric label), got {self.name!r}"
        if self.routing is not None:
            err = policy_name_error(self.routing.policy)
            if err is not None:
                yield "routing.policy", err
        if len(set(self.backends)) != len(self.backends):
            yield "backends", "must not repeat a backend"


@dataclass(frozen=True)
class ExperimentConfig:
    name: str = ""
    control: str = ""  # the name of the control arm
    arms: tuple[ArmConfig, ...] = field(default=(), metadata={"min_len": 2})
    model: str | None = None  # only requests for this model take part; None: every request
    guardrails: tuple[GuardrailConfig, ...] = ()
    floor: float = field(default=0.01, metadata={"ge": 0.0, "le": 1.0})  # a cut never goes below this share
    cooldown_s: float = field(default=10.0, metadata={"ge": 0.0})  # at least this long between two actions on an arm
    restore_after_s: float = field(default=30.0, metadata={"ge": 0.0})  # clean this long -> step the weight up
    restore_factor: float = field(default=2.0, metadata={"gt": 1.0})
    auto_promote_after_s: float | None = field(default=None, metadata={"gt": 0.0})

    def __post_init__(self) -> None:
        check_config(self)

    @property
    def control_arm(self) -> ArmConfig:
        return next(a for a in self.arms if a.name == self.control)

    @property
    def candidates(self) -> tuple[ArmConfig, ...]:
        return tuple(a for a in self.arms if a.name != self.control)

    def share_of(self, arm: str) -> float:
        """The configured share of an arm (the control arm: what the candidates leave)."""
        if arm == self.control:
            return max(0.0, 1.0 - sum(a.share or 0.0 for a in self.candidates))
        return next(a.share or 0.0 for a in self.arms if a.name == arm)

    def validate(self) -> Iterable[tuple[str, str]]:
        if not re.fullmatch(r"[A-Za-z0-9_.:-]+", self.name):
            yield "name", f"must be a non-empty name of letters, digits and _.:- (a metric label), got {self.name!r}"
        names = [a.name for a in self.arms]
        for i, n in enumerate(names):
            if n in names[:i]:
                yield f"arms[{i}].name", f"duplicate arm name {n!r}"
        if self.control not in names:
            yield "control", f"must name one of the arms ({', '.join(names)}), got {self.control!r}"
            return
        total = 0.0
        for i, a in enumerate(self.arms):
            if a.name == self.control:
                continue
            if a.share is None:
                yield f"arms[{i}].share", "is required for a candidate arm"
            else:
                total += a.share
        if total > 1.0 + 1e-9:
            yield "arms", f"the candidates' shares add up to {total:g}, more than 1"
        ctl = self.control_arm
        if ctl.share is not None and abs(ctl.share - (1.0 - total)) > 1e-6:
            yield f"arms[{names.index(self.control)}].share", \
                f"the control arm takes what the candidates leave ({1.0 - total:g}); leave share out or write that"
        claimed: dict[str, str] = {}
        for i, a in enumerate(self.arms):
            for b in a.backends:
                if b in claimed:
                    yield f"arms[{i}].backends", f"backend {b!r} is already in arm {claimed[b]!r}'s group"
                claimed.setdefault(b, a.name)


@dataclass(frozen=True)
class ExperimentsConfig:
    """The `experiments:` section."""

    definitions: tuple[ExperimentConfig, ...] = ()
    evaluate_every_s: float = field(default=5.0, metadata={"gt": 0.0})  # how often the guardrails run
    window_s: float = field(default=30.0, metadata={"gt": 0.0})  # the sliding window they read
    # A request header naming `experiment/arm` (or just `arm`) pins a request to that arm, for debugging.
    # With admin.token configured the request must also carry `pin_token_header: <token>`.
    pin_header: str | None = "x-affinity-arm"
    pin_token_header: str = "x-affinity-arm-token"

    def __post_init__(self) -> None:
        check_config(self)

    def validate(self) -> Iterable[tuple[str, str]]:
        seen: dict[str, int] = {}
        scopes: dict[str | None, str] = {}  # model -> the experiment that takes its requests
        for i, e in enumerate(self.definitions):
            if e.name in seen:
                yield f"definitions[{i}].name", f"duplicate experiment name {e.name!r}"
            seen.setdefault(e.name, i)
            if e.model in scopes:
                yield f"definitions[{i}].model", (
                    f"overlaps experiment {scopes[e.model]!r}: a request can be in only one experiment")
            elif None in scopes:
                yield f"definitions[{i}].model", (
                    f"experiment {scopes[None]!r} (no model) comes first and takes every request; list it last")
            scopes.setdefault(e.model, e.name)

    def find(self, name: str) -> ExperimentConfig | None:
        return next((e for e in self.definitions if e.name == name), None)


def backend_group_errors(cfg: ExperimentsConfig, backends: Sequence[str]) -> Iterable[tuple[str, str]]:
    """Canary groups naming backends the configuration does not have (a cross-section check for Config)."""
    known = set(backends)
    for i, e in enumerate(cfg.definitions):
        for j, a in enumerate(e.arms):
            for b in a.backends:
                if b not in known:
                    yield f"experiments.definitions[{i}].arms[{j}].backends", f"unknown backend {b!r}"


# ---------------------------------------------------------------------------------------------- assignment


def assignment_key(req: RequestSummary) -> bytes:
    """What a request is assigned by: session key, else its conversation's prefix, else its prompt."""
    if req.session_key:
        return b"s\xff" + req.session_key.encode("utf-8", "surrogatepass")
    cut = req.key_prefix_chars
    if cut is not None and 0 < cut <= len(req.prompt):
        return b"p\xff" + req.prompt[:cut].encode("utf-8", "surrogatepass")
    return b"f\xff" + req.prompt_bytes


def experiment_seed(name: str) -> int:
    return _xxh3(_ASSIGN_DOMAIN + name.encode("utf-8"))


def assignment_point(key: bytes, seed: int) -> float:
    """The key's point in [0, 1) for the experiment whose seed is `seed`."""
    return _xxh3(key, seed) / _TWO_64


def assign(cfg: ExperimentConfig, weights: Mapping[str, float], point: float, promoted: str | None = None) -> str:
    """The arm of a point under the current candidate weights (see the module doc for the layout)."""
    if promoted is not None:
        return promoted
    base = 0.0
    for arm in cfg.arms:
        if arm.name == cfg.control:
            continue
        share = arm.share or 0.0
        if base <= point < base + min(share, weights.get(arm.name, share)):
            return arm.name
        base += share
    return cfg.control


# ---------------------------------------------------------------------------------------------- guardrails


@dataclass(frozen=True, slots=True)
class ArmWindow:
    """One arm's aggregates over the sliding window (what `source: proxy` rules read)."""

    requests: int = 0
    errors: int = 0
    ttft_p99: float | None = None
    e2e_p99: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0

    @property
    def error_rate(self) -> float | None:
        return self.errors / self.requests if self.requests else None

    @property
    def hit_ratio(self) -> float | None:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None

    def metric(self, name: str) -> float | None:
        value: float | None = getattr(self, name)
        return value


@dataclass(frozen=True, slots=True)
class ArmState:
    weight: float  # current share of traffic (candidates); the control arm's is what is left
    last_action_at: float | None = None
    clean_since: float | None = None  # since when no rule has fired for this arm (None: one fired last time)


@dataclass(frozen=True, slots=True)
class ExperimentState:
    arms: Mapping[str, ArmState]  # candidates only
    promoted: str | None = None

    def weights(self) -> dict[str, float]:
        return {name: s.weight for name, s in self.arms.items()}


@dataclass(frozen=True, slots=True)
class Action:
    experiment: str
    arm: str
    kind: Literal["cut", "restore", "promote"]
    old_weight: float
    new_weight: float
    reasons: tuple[str, ...]
    at: float

    def as_json(self) -> dict[str, object]:
        return {"experiment": self.experiment, "arm": self.arm, "action": self.kind,
                "old_weight": round(self.old_weight, 6), "new_weight": round(self.new_weight, 6),
                "reasons": list(self.reasons), "at": self.at}


def initial_state(cfg: ExperimentConfig) -> ExperimentState:
    return ExperimentState({a.name: ArmState(cfg.share_of(a.name)) for a in cfg.candidates})


def carry_state(old_cfg: ExperimentConfig | None, old: ExperimentState | None, new_cfg: ExperimentConfig) -> ExperimentState:
    """A reload's state: arms whose configured share did not change keep their learned weight and timers."""
    if old_cfg is None or old is None:
        return initial_state(new_cfg)
    arms: dict[str, ArmState] = {}
    for a in new_cfg.candidates:
        prev = old.arms.get(a.name)
        if prev is not None and a.name != old_cfg.control and old_cfg.share_of(a.name) == new_cfg.share_of(a.name):
            arms[a.name] = prev
        else:
            arms[a.name] = ArmState(new_cfg.share_of(a.name))
    promoted = old.promoted if old.promoted in {a.name for a in new_cfg.arms} else None
    return ExperimentState(arms, promoted)


Readings = Mapping[int, Mapping[str, float | None]]  # rule index -> arm -> value (None: no data)


def readings_from_windows(cfg: ExperimentConfig, windows: Mapping[str, ArmWindow]) -> dict[int, dict[str, float | None]]:
    """The readings of the `source: proxy` rules from the per-arm window aggregates; an arm with fewer
    requests than the rule's `min_requests` reads None (not judged)."""
    out: dict[int, dict[str, float | None]] = {}
    for i, rule in enumerate(cfg.guardrails):
        if rule.source != "proxy":
            continue
        metric = rule.condition.metric
        values: dict[str, float | None] = {}
        for arm in cfg.arms:
            w = windows.get(arm.name, ArmWindow())
            values[arm.name] = w.metric(metric) if w.requests >= rule.min_requests else None
        out[i] = values
    return out


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"


def evaluate(cfg: ExperimentConfig, state: ExperimentState, readings: Readings, now: float) -> tuple[ExperimentState, list[Action]]:
    """One guardrail pass: the next state and the actions taken (see the module doc)."""
    if state.promoted is not None:
        return state, []
    arms = dict(state.arms)
    actions: list[Action] = []
    conditions = [rule.condition for rule in cfg.guardrails]
    for arm in cfg.candidates:
        s = arms.get(arm.name) or ArmState(cfg.share_of(arm.name))
        share = cfg.share_of(arm.name)
        fired: list[tuple[float, str]] = []
        for i, (rule, cond) in enumerate(zip(cfg.guardrails, conditions, strict=True)):
            values = readings.get(i, {})
            reading = values.get(arm.name)
            control = values.get(cfg.control) if cond.relative else None
            if cond.fires(reading, control):
                bound = cond.threshold(control)
                ctl = f", control {_fmt(control)}" if cond.relative else ""
                fired.append((rule.factor, f"{cond} ({rule.source}): {cond.metric} {_fmt(reading)}"
                                           f" vs bound {_fmt(bound)}{ctl}; weight x {rule.factor:g}"))
        cooled = s.last_action_at is None or now - s.last_action_at >= cfg.cooldown_s
        if fired:
            s = replace(s, clean_since=None)
            factor = min(f for f, _ in fired)
            new = max(cfg.floor, s.weight * factor) if s.weight > cfg.floor else s.weight
            if cooled and new < s.weight:
                actions.append(Action(cfg.name, arm.name, "cut", s.weight, new, tuple(r for _, r in fired), now))
                s = ArmState(new, now, None)
            arms[arm.name] = s
            continue
        if s.clean_since is None:
            s = replace(s, clean_since=now)
        clean_for = now - (s.clean_since if s.clean_since is not None else now)
        if s.weight < share and cooled and clean_for >= cfg.restore_after_s:
            new = min(share, max(s.weight * cfg.restore_factor, MIN_RESTORE_WEIGHT))
            actions.append(Action(cfg.name, arm.name, "restore", s.weight, new,
                                  (f"no rule fired for {clean_for:.0f}s (restore_after_s {cfg.restore_after_s:g})",), now))
            s = ArmState(new, now, now)
        elif (cfg.auto_promote_after_s is not None and s.weight >= share > 0 and cooled
              and clean_for >= cfg.auto_promote_after_s):
            actions.append(Action(cfg.name, arm.name, "promote", s.weight, 1.0,
                                  (f"clean at its full share for {clean_for:.0f}s "
                                   f"(auto_promote_after_s {cfg.auto_promote_after_s:g})",), now))
            arms[arm.name] = ArmState(1.0, now, s.clean_since)
            return ExperimentState(arms, arm.name), actions
        arms[arm.name] = s
    return ExperimentState(arms, None), actions
