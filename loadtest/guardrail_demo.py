"""The guardrail scenario, live: a candidate arm's backends start failing, its weight is cut, then restored.

    python -m loadtest.guardrail_demo [--out loadtest/results] [--source proxy|prometheus]

Runs in one process: a simulated fleet of 4 GPUs (sim/), the proxy with a 50/50 experiment (`stable` on
two backends, `candidate` on the other two, round robin), and a closed-loop client of multi-turn chats.
Phases: baseline -> a 10% 5xx fault on the candidate's backends (POST /sim/faults) -> the rule
`error_rate > 0.02 -> weight x 0.3` cuts the candidate down to its floor -> the fault clears -> after a
clean window the weight steps back up. Writes experiments.md (table) and experiments.png (each arm's
weight, TTFT p99 and error rate over time, from the runtime's per-evaluation timeline) under --out.

tests/experiments/test_guardrails.py runs the same `run_scenario` with assertions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import aiohttp

from proxy.app import AffinityProxy
from proxy.config import Config, parse_config
from sim.fleet import Fleet, start_fleet

SYSTEM = "You are a concise assistant."


def experiment_yaml(candidate: list[str], *, rule: str, window_s: float = 3.0, evaluate_every_s: float = 1.0,
                    extra_arm: str = "") -> str:
    return (f"  evaluate_every_s: {evaluate_every_s}\n  window_s: {window_s}\n  definitions:\n"
            "    - name: guard\n      control: stable\n      floor: 0.05\n      cooldown_s: 2\n"
            "      restore_after_s: 3\n      restore_factor: 2\n      arms:\n        - {name: stable}\n"
            f"        - {{name: candidate, share: 0.5, backends: [{', '.join(candidate)}], "
            f"routing: {{policy: round_robin}}{extra_arm}}}\n      guardrails:\n{rule}")


PROXY_RULE = "        - {when: \"error_rate > 0.02\", factor: 0.3, min_requests: 30}\n"


def promql_rule(prometheus_url: str) -> str:
    query = ('sum(rate(affinity_proxy_experiment_errors_total{experiment="guard",arm="{arm}"}[4s])) / '
             'sum(rate(affinity_proxy_experiment_requests_total{experiment="guard",arm="{arm}"}[4s]))')
    return (f"        - {{when: \"error_rate > 0.02\", factor: 0.3, source: prometheus, "
            f"prometheus_url: '{prometheus_url}', query: '{query}'}}\n")


def proxy_config(fleet: Fleet, experiments: str, *, admin_port: int = 0) -> Config:
    backends = "\n".join(f"  - {{name: {s.name}, url: '{s.url}'}}" for s in fleet.servers)
    return parse_config(
        f"listen: {{host: 127.0.0.1, port: 0}}\nadmin: {{host: 127.0.0.1, port: {admin_port}}}\ndebug_headers: true\n"
        "telemetry: {enabled: false}\nhealth_checks: {enabled: false}\noutlier_detection: {enabled: false}\n"
        "retries: {enabled: false}\ntimeouts: {drain_s: 10}\n"
        f"experiments:\n{experiments}backends:\n{backends}\n")


@dataclass
class Sample:
    t: float
    status: int
    backend: str | None
    conversation: int
    turn: int


@dataclass
class Phase:
    name: str
    start: float
    end: float
    requests: int = 0
    errors: int = 0
    on_candidate: int = 0

    @property
    def error_share(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    @property
    def candidate_share(self) -> float:
        return self.on_candidate / self.requests if self.requests else 0.0


@dataclass
class ScenarioResult:
    samples: list[Sample]
    marks: dict[str, float]  # event -> monotonic time
    history: list[dict[str, Any]]
    timeline: list[dict[str, Any]]
    phases: list[Phase] = field(default_factory=list)
    candidate: list[str] = field(default_factory=list)


async def _client(url: str, model: str, stop: Callable[[], bool], out: list[Sample], concurrency: int,
                  turns: int = 3) -> None:
    counter = [0]
    async with aiohttp.ClientSession() as s:
        async def worker() -> None:
            while not stop():
                conv = counter[0]
                counter[0] += 1
                msgs = [{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": f"conversation {conv}: describe lake number {conv}."}]
                for turn in range(turns):
                    if stop():
                        return
                    try:
                        async with s.post(url + "/v1/chat/completions",
                                          json={"model": model, "max_tokens": 2, "messages": msgs}) as resp:
                            await resp.read()
                            out.append(Sample(time.monotonic(), resp.status, resp.headers.get("x-affinity-backend"),
                                              conv, turn))
                    except aiohttp.ClientError:
                        out.append(Sample(time.monotonic(), 599, None, conv, turn))
                    msgs = msgs + [{"role": "assistant", "content": f"part {turn} of lake {conv}"},
                                   {"role": "user", "content": "go on"}]

        await asyncio.gather(*(worker() for _ in range(concurrency)))


async def _wait(cond: Callable[[], bool], timeout: float, what: str) -> float:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(0.05)
    return time.monotonic()


async def run_scenario(fleet: Fleet, proxy: AffinityProxy, candidate: list[str], *, fault: dict[str, Any] | None = None,
                       baseline_s: float = 2.0, floor_hold_s: float = 4.0, concurrency: int = 8,
                       timeout_s: float = 30.0, until_full: bool = False) -> ScenarioResult:
    """Baseline, fault on the candidate's backends, cut to the floor, hold, fault cleared, first restore
    (`until_full`: and on until the weight is back at its configured share)."""
    fault = fault or {"fail_rate": 0.1, "fail_status": 500}
    model = fleet.servers[0].backend.engine.model_name
    runtime = proxy.experiments
    samples: list[Sample] = []
    stopped = [False]
    marks: dict[str, float] = {}
    client = asyncio.create_task(_client(proxy.http_url, model, lambda: stopped[0], samples, concurrency))
    servers = [s for s in fleet.servers if s.name in candidate]

    def weight() -> float:
        return runtime.weights("guard")["candidate"]

    def actions(kind: str) -> list[dict[str, Any]]:
        return [h for h in runtime.as_json()["experiments"][0]["history"] if h["action"] == kind]

    try:
        marks["start"] = time.monotonic()
        await asyncio.sleep(baseline_s)
        for s in servers:
            await s.set_faults(fault)
        marks["fault"] = time.monotonic()
        marks["cut"] = await _wait(lambda: bool(actions("cut")), timeout_s, "the first cut")
        marks["floor"] = await _wait(lambda: weight() <= 0.05 + 1e-9, timeout_s, "the weight at its floor")
        await asyncio.sleep(floor_hold_s)
        for s in servers:
            await s.set_faults({"fail_rate": 0.0})
        marks["clear"] = time.monotonic()
        marks["restore"] = await _wait(lambda: bool(actions("restore")), timeout_s, "the first restore")
        if until_full:
            await _wait(lambda: weight() >= 0.5 - 1e-9, 4 * timeout_s, "the weight back at its share")
        await asyncio.sleep(2.5)
        marks["end"] = time.monotonic()
    finally:
        stopped[0] = True
        await client
    data = runtime.as_json(timeline=True)["experiments"][0]
    result = ScenarioResult(samples, marks, data["history"], data["timeline"], candidate=candidate)
    bounds = [("baseline", "start", "fault"), ("fault, full weight", "fault", "cut"),
              ("fault, cutting", "cut", "floor"), ("fault, at floor", "floor", "clear"),
              ("fault cleared", "clear", "restore"), ("restored", "restore", "end")]
    for name, a, b in bounds:
        p = Phase(name, marks[a], marks[b])
        for smp in samples:
            if p.start <= smp.t < p.end:
                p.requests += 1
                p.errors += smp.status >= 500
                p.on_candidate += smp.backend in candidate
        result.phases.append(p)
    return result


def write_report(result: ScenarioResult, out: Path, source: str, command: str) -> tuple[Path, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    t0 = result.marks["start"]
    md = out / "experiments.md"
    png = out / "experiments.png"
    lines = [
        "# Guardrail scenario: a candidate arm's backends fail 10% of requests",
        "",
        f"Command: `{command}` (rule source: `{source}`). One run, in one process: 4 simulated GPUs (sim/, speed",
        "50), the proxy with a 50/50 experiment (`stable` on two backends with `affinity`, `candidate` on the other",
        "two with `round_robin`), a closed-loop client of 3-turn chats (8 at a time, max_tokens 2). Rule",
        "`error_rate > 0.02 -> weight x 0.3` over a 3 s window, evaluated every 1 s; floor 0.05, cool-down 2 s,",
        "restore x2 after 3 s clean. The fault is `POST /sim/faults {\"fail_rate\": 0.1}` on both candidate",
        "backends. Times are seconds from the start of the run.",
        "",
        "| phase | from (s) | to (s) | requests | client 5xx share | share on candidate backends |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for p in result.phases:
        lines.append(f"| {p.name} | {p.start - t0:.1f} | {p.end - t0:.1f} | {p.requests} | {100 * p.error_share:.2f}% "
                     f"| {100 * p.candidate_share:.1f}% |")
    lines += ["", "Actions (the experiment's history, as `GET /admin/experiments` shows it):", "",
              "| t (s) | action | arm | weight | reason |", "|---:|---|---|---|---|"]
    for h in result.history:
        t = h["at"] - t0
        lines.append(f"| {t:.1f} | {h['action']} | {h['arm']} | {h['old_weight']:.3f} -> {h['new_weight']:.3f} | "
                     f"{'; '.join(h['reasons'])} |")
    fault_to_cut = result.marks["cut"] - result.marks["fault"]
    lines += ["", f"Fault to first cut: {fault_to_cut:.1f} s; fault cleared to first restore: "
              f"{result.marks['restore'] - result.marks['clear']:.1f} s (the window must first forget the failures).",
              "", "![weights, TTFT p99 and error rate per arm over time](experiments.png)", ""]
    md.write_text("\n".join(lines))

    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    for arm in ("stable", "candidate"):
        ts = [e["t"] - t0 for e in result.timeline]
        arms = [e["arms"][arm] for e in result.timeline]
        axes[0].step(ts, [a["weight"] for a in arms], where="post", label=arm)
        axes[1].plot(ts, [1000 * a["ttft_p99_s"] if a["ttft_p99_s"] is not None else float("nan") for a in arms],
                     label=arm)
        axes[2].plot(ts, [100 * a["error_rate"] if a["error_rate"] is not None else float("nan") for a in arms],
                     label=arm)
    for ax, label in zip(axes, ("weight (share)", "TTFT p99 (ms, 3 s window)", "error rate (%, 3 s window)")):
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        for mark, style in (("fault", "r--"), ("clear", "g--")):
            ax.axvline(result.marks[mark] - t0, color=style[0], linestyle="--", linewidth=1)
    axes[0].legend()
    axes[2].set_xlabel("seconds (red: fault on, green: fault cleared)")
    fig.suptitle("Guardrail: candidate arm cut on error_rate > 2%, restored after a clean window")
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)
    return md, png


async def _main(args: argparse.Namespace) -> None:
    fleet = await start_fleet(4, host="127.0.0.1", port=0, speed=50.0)
    candidate = [s.name for s in fleet.servers[2:]]
    prom = None
    try:
        if args.source == "prometheus":
            from loadtest.prometheus_proc import start_prometheus

            admin_port = _free_port()
            prom = await start_prometheus(f"127.0.0.1:{admin_port}", Path(args.out) / ".prometheus-data")
            config = proxy_config(fleet, experiment_yaml(candidate, rule=promql_rule(prom.url)), admin_port=admin_port)
        else:
            config = proxy_config(fleet, experiment_yaml(candidate, rule=PROXY_RULE))
        proxy = AffinityProxy(config)
        await proxy.start()
        try:
            result = await run_scenario(fleet, proxy, candidate, until_full=True)
        finally:
            await proxy.stop()
    finally:
        if prom is not None:
            await prom.stop()
        await fleet.stop()
    command = "python -m loadtest.guardrail_demo" + (" --source prometheus" if args.source == "prometheus" else "")
    md, png = write_report(result, Path(args.out), args.source, command)
    (Path(args.out) / "experiments.json").write_text(json.dumps(
        {"marks": result.marks, "history": result.history, "timeline": result.timeline,
         "phases": [p.__dict__ for p in result.phases]}, indent=1))
    print(md.read_text())
    print(f"wrote {md} and {png}")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="loadtest/results")
    parser.add_argument("--source", choices=("proxy", "prometheus"), default="proxy")
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
