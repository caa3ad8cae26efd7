"""The same experiment offline: split a trace between an experiment's arms in virtual time, report per arm.

    python -m loadtest.experiment_replay --experiments exp.yaml --workload chat --limit 2000 --backends 4 \\
        [--out loadtest/results/experiment-replay.md]

`exp.yaml` holds an `experiments:` section exactly as in the proxy's configuration (a whole proxy config
file works too: its `routing:` and `experiments:` are read, the rest ignored). The replay's backends are
named like the live simulator's (`sim-0` .. `sim-N-1`), so canary groups name those.

Drives loadtest/replay.py's `replay` with one policy object that does what the live Router does for an
experiment: assign each request to an arm with proxy/core/experiments.py (the same sticky hash, so a
conversation's arm offline is its arm live), then pick with the arm's own policy among the arm's backends.
Requests outside the experiment (another model) are routed by the `routing:` policy. The split is the
configured one: guardrails act on live measurements and are not simulated here; run
`python -m loadtest.guardrail_demo` to see them act.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from loadtest.records import Record, RunResult
from loadtest.replay import ReplayConfig, replay
from loadtest.run import add_workload_args, prepare_workload
from loadtest.workloads import Workload
from proxy.config import parse_section
from proxy.core.decision import Decision, Inflight
from proxy.core.experiments import (
    ExperimentConfig, ExperimentsConfig, assign, assignment_key, assignment_point, experiment_seed,
)
from proxy.core.registry import build_policy
from proxy.core.request import RequestSummary
from proxy.core.routing_config import RoutingConfig
from proxy.core.snapshot import Snapshot


class ExperimentPolicy:
    """A `Policy` that routes each request with its experiment arm's policy, among the arm's backends."""

    name = "experiment"

    def __init__(self, experiments: ExperimentsConfig, routing: RoutingConfig, backends: Sequence[str]) -> None:
        self.experiments = experiments.definitions
        self.default = build_policy(routing)
        self.arms: list[str | None] = []  # "experiment/arm" of every pick, in order (None: in no experiment)
        self._policies: dict[str, Any] = {}
        self._outside: dict[str, frozenset[str]] = {}
        self._seeds = {e.name: experiment_seed(e.name) for e in self.experiments}
        for e in self.experiments:
            for arm in e.arms:
                key = f"{e.name}/{arm.name}"
                self._policies[key] = build_policy(arm.routing) if arm.routing is not None else self.default
                claimed = {b for a in e.arms if a.name != arm.name for b in a.backends}
                if arm.backends:
                    self._outside[key] = frozenset(b for b in backends if b not in arm.backends)
                else:
                    self._outside[key] = frozenset(b for b in backends if b in claimed)

    def _arm(self, req: RequestSummary) -> str | None:
        for e in self.experiments:
            if e.model is not None and req.model != e.model:
                continue
            shares = {a.name: e.share_of(a.name) for a in e.candidates}
            return f"{e.name}/{assign(e, shares, assignment_point(assignment_key(req), self._seeds[e.name]))}"
        return None

    def pick(self, req: RequestSummary, snapshot: Snapshot, inflight: Mapping[str, Inflight],
             exclude: frozenset[str] = frozenset()) -> Decision:
        arm = self._arm(req)
        self.arms.append(arm)
        if arm is None:
            return self.default.pick(req, snapshot, inflight, exclude)
        return self._policies[arm].pick(req, snapshot, inflight, exclude | self._outside[arm])


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def per_arm(result: RunResult, arms: Sequence[str | None]) -> dict[str, dict[str, Any]]:
    """Per-arm figures of a replay: requests, errors, TTFT p50/p99, e2e p99, prefix-cache hit ratio."""
    groups: dict[str, list[Record]] = {}
    for rec in result.records:
        groups.setdefault(arms[rec.index] or "(no experiment)", []).append(rec)
    total = len(result.records)
    out: dict[str, dict[str, Any]] = {}
    for arm, recs in sorted(groups.items()):
        ok = [r for r in recs if r.status == 200]
        ttft = [r.ttft for r in ok if r.ttft is not None]
        e2e = [r.e2e for r in ok if r.e2e is not None]
        prompt = sum(r.input_tokens for r in ok)
        cached = sum(r.cached_tokens or 0 for r in ok)
        out[arm] = {
            "requests": len(recs), "share": len(recs) / total if total else 0.0, "errors": len(recs) - len(ok),
            "ttft_p50_s": _pct(ttft, 0.5), "ttft_p99_s": _pct(ttft, 0.99), "e2e_p99_s": _pct(e2e, 0.99),
            "hit_ratio": cached / prompt if prompt else None,
            "backends": dict(Counter(r.backend for r in recs if r.backend)),
        }
    return out


async def replay_experiment(workload: Workload, experiments: ExperimentsConfig, routing: RoutingConfig,
                            cfg: ReplayConfig) -> tuple[RunResult, dict[str, dict[str, Any]]]:
    names = [f"sim-{i}" for i in range(cfg.backends)]  # replay.py's backend names
    policy = ExperimentPolicy(experiments, routing, names)
    result = await replay(workload, cfg, policy=policy)
    return result, per_arm(result, policy.arms)


def load_experiments(path: Path) -> tuple[ExperimentsConfig, RoutingConfig]:
    """The `experiments:` (and `routing:`) sections of a YAML file, checked as the proxy checks them."""
    text = path.read_text()
    doc = yaml.safe_load(text) or {}
    if not isinstance(doc, dict) or "experiments" not in doc:
        raise SystemExit(f"{path}: no `experiments:` section")
    experiments = parse_section(ExperimentsConfig, yaml.safe_dump(doc["experiments"]), str(path))
    routing = parse_section(RoutingConfig, yaml.safe_dump(doc.get("routing") or {}), str(path))
    return experiments, routing


def markdown(table: dict[str, dict[str, Any]], title: str, command: str) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f}"

    lines = [f"# {title}", "", f"Command: `{command}`", "",
             "| arm | requests | share | errors | TTFT p50 (ms) | TTFT p99 (ms) | e2e p99 (ms) | hit ratio | backends |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for arm, row in table.items():
        hit = "-" if row["hit_ratio"] is None else f"{100 * row['hit_ratio']:.1f}%"
        backends = ", ".join(f"{b}: {n}" for b, n in sorted(row["backends"].items()))
        lines.append(f"| {arm} | {row['requests']} | {100 * row['share']:.1f}% | {row['errors']} | "
                     f"{ms(row['ttft_p50_s'])} | {ms(row['ttft_p99_s'])} | {ms(row['e2e_p99_s'])} | {hit} | {backends} |")
    lines += ["", "Arms that share backends share their queues and caches (one arm's requests evict the other's",
              "prefixes), exactly as they do live; a canary group (`backends:`) isolates them. The split is the",
              "configured one: guardrails are not simulated offline (see loadtest/guardrail_demo.py)."]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m loadtest.experiment_replay", description=__doc__.split("\n")[0])
    add_workload_args(ap)
    ap.add_argument("--experiments", type=Path, required=True, help="YAML file with an `experiments:` section")
    ap.add_argument("--backends", type=int, default=4)
    ap.add_argument("--profile", default="llama3-8b-h100")
    ap.add_argument("--max-model-len", type=int, default=131072, help="context limit of the simulated model (as replay)")
    ap.add_argument("--speed", type=float, default=1.0)
    ap.add_argument("--out", type=Path, help="write the per-arm table here (markdown) and a .json beside it")
    args = ap.parse_args(argv)
    experiments, routing = load_experiments(args.experiments)
    workload = prepare_workload(args)
    # policy "affinity" only makes the replay poll telemetry, which the arms' load-aware policies read
    cfg = ReplayConfig(policy="affinity", backends=args.backends, profile=args.profile,
                       max_model_len=args.max_model_len, speed=args.speed, seed=args.seed)
    result, table = asyncio.run(replay_experiment(workload, experiments, routing, cfg))
    command = "python -m loadtest.experiment_replay " + " ".join(argv if argv is not None else sys.argv[1:])
    text = markdown(table, f"offline experiment replay: {workload.name}", command)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
