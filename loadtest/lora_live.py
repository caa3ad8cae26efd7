"""Replay vs live on a LoRA workload (issue 14): does `loadtest.replay` route a LoRA fleet as the proxy does?

    python -m loadtest.lora_live --requests 400 --rate 6 --adapters 4 --base-share 0.3 \\
        --out loadtest/results/lora-live

A seeded workload (`loadtest.workloads.synthetic.lora`: Zipf over `--adapters` adapters, so `lora-0` is hot
and the last ones are cold, each adapter with its own system prompt; a `--base-share` of the requests ask
for the base model instead). A fresh simulated fleet (`python -m sim`, its own process, real time) with no
adapter at start; each adapter is then registered through the runtime LoRA API (`/v1/load_lora_adapter`)
on the backends of the placement (default: hot adapters on two backends, cold ones on one). One
`python -m proxy run --workers 1` in front, `affinity`, telemetry on, with the adapters declared per
backend (`backends[].adapters`) or, with `--discover`, learned from the engines' `/v1/models`. The workload
is sent open-loop through it (loadtest.live_replicas' driver), then `loadtest.replay` runs the same
workload, fleet, placement and config in virtual time.

The report gives, live and replay, each backend's share of all requests and, per model (each adapter and
the base), each backend's share of that model's requests, with the largest absolute difference in
percentage points; agreement means every difference is at most `--tolerance` (5 points by default).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

import aiohttp

from loadtest.harness import PYTHON, Proc, free_port, spawn, temp_workdir, wait_http
from loadtest.live_replicas import MODEL, LiveSpec, drive, start_sim_fleet
from loadtest.records import RunResult
from loadtest.replay import ReplayConfig, replay
from loadtest.workloads import Workload
from loadtest.workloads.synthetic import LoraParams, lora

BASE = "base"  # the label of base-model requests in the per-model tables

Placement = dict[str, tuple[str, ...]]  # backend -> adapters registered there


@dataclasses.dataclass(frozen=True)
class LoraLiveSpec:
    requests: int = 400
    rate: float = 6.0
    adapters: int = 4
    base_share: float = 0.3
    backends: int = 4
    hot_copies: int = 2  # backends holding each hot adapter (the first half by Zipf rank)
    discover: bool = False  # adapters learned from /v1/models only, not declared in the config
    speed: float = 1.0
    seed: int = 0
    system_tokens: int = 600
    question_tokens: tuple[int, int] = (50, 300)
    answer_tokens: tuple[int, int] = (20, 120)
    max_model_len: int = 131072
    timeout_s: float = 300.0
    tolerance: float = 0.05


def adapter_names(spec: LoraLiveSpec) -> list[str]:
    return [f"lora-{k}" for k in range(spec.adapters)]


def default_placement(spec: LoraLiveSpec) -> Placement:
    """Hot adapters (the first half by Zipf rank) on `hot_copies` consecutive backends, cold ones on one,
    walking round the fleet so that every backend gets some."""
    names = [f"sim-{i}" for i in range(spec.backends)]
    out: dict[str, list[str]] = {n: [] for n in names}
    slot = 0
    hot = (spec.adapters + 1) // 2
    for k, a in enumerate(adapter_names(spec)):
        copies = min(spec.hot_copies, spec.backends) if k < hot else 1
        for _ in range(copies):
            out[names[slot % spec.backends]].append(a)
            slot += 1
    return {n: tuple(v) for n, v in out.items()}


def parse_placement(text: str) -> Placement:
    """`sim-0=lora-0+lora-2,sim-1=lora-0` -> {"sim-0": ("lora-0", "lora-2"), "sim-1": ("lora-0",)}."""
    out: Placement = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, adapters = part.partition("=")
        if not eq or not name.strip():
            raise ValueError(f"--placement expects BACKEND=ADAPTER+ADAPTER,..., got {part!r}")
        out[name.strip()] = tuple(a.strip() for a in adapters.split("+") if a.strip())
    return out


def build_workload(spec: LoraLiveSpec) -> Workload:
    """The `lora` synthetic workload with a seeded `base_share` of its requests turned to the base model."""
    w = lora(LoraParams(requests=spec.requests, rate=spec.rate, adapters=spec.adapters, adapter_prefix="lora-",
                        system_tokens=spec.system_tokens, question_tokens=spec.question_tokens,
                        answer_tokens=spec.answer_tokens, seed=spec.seed))
    rng = random.Random(spec.seed ^ 0xBA5E)
    items = [dataclasses.replace(it, model=None) if rng.random() < spec.base_share else it for it in w.items]
    return Workload("synthetic:lora+base", items, w.block_tokens, w.namespace,
                    f"{w.source} base_share={spec.base_share}", w.meta)


def proxy_config_yaml(spec: LoraLiveSpec, servers: Sequence[dict[str, Any]], placement: Placement,
                      port: int, admin_port: int) -> str:
    """The proxy's defaults (affinity, telemetry every 200 ms = the replay's poll), the fleet's backends with
    their adapters declared unless `discover` (no `models:` list: every backend serves any model, as the
    replay's do)."""
    lines = [
        f"listen: {{host: 127.0.0.1, port: {port}}}",
        f"admin: {{host: 127.0.0.1, port: {admin_port}}}",
        "debug_headers: true",
        "routing:",
        "  policy: affinity",
        f"  seed: {spec.seed}",
        "backends:",
    ]
    for s in servers:
        adapters = placement.get(s["name"], ())
        declared = f", adapters: [{', '.join(adapters)}]" if adapters and not spec.discover else ""
        lines.append(f"  - {{name: {s['name']}, url: '{s['url']}'{declared}}}")
    return "\n".join(lines) + "\n"


async def register_adapters(servers: Sequence[dict[str, Any]], placement: Placement) -> None:
    """Each placed adapter through the engine's runtime LoRA API, as an operator (or the pool) loads it."""
    by_name = {s["name"]: s["url"] for s in servers}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        for backend, adapters in placement.items():
            for a in adapters:
                async with session.post(by_name[backend] + "/v1/load_lora_adapter",
                                        json={"lora_name": a, "lora_path": f"/adapters/{a}"}) as resp:
                    if resp.status != 200:
                        raise RuntimeError(f"loading {a} on {backend}: {resp.status} {await resp.text()}")


async def wait_for_discovery(admin_url: str, placement: Placement, timeout_s: float = 30.0) -> None:
    """Until the proxy's admin API lists every placed adapter on its backend (the first discovery round)."""
    want = {(b, a) for b, adapters in placement.items() for a in adapters}
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while True:
            async with session.get(admin_url + "/admin/backends") as resp:
                data = await resp.json()
            have = {(r["name"], a) for r in data["backends"]
                    for a in ((r.get("signals") or {}).get("loaded_adapters") or ())}
            if want <= have:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the proxy did not discover {sorted(want - have)} in {timeout_s:g} s")
            await asyncio.sleep(0.2)


async def live_run(spec: LoraLiveSpec, workload: Workload, placement: Placement, workdir: Path) -> RunResult:
    fleet_spec = LiveSpec(backends=spec.backends, replicas=1, index="learned", load_view="own",
                          max_model_len=spec.max_model_len, speed=spec.speed, seed=spec.seed,
                          timeout_s=spec.timeout_s)
    fleet = await start_sim_fleet(fleet_spec, workdir)
    proxy: Proc | None = None
    try:
        servers = fleet.info["servers"]
        await register_adapters(servers, placement)
        port, admin = free_port(), free_port()
        cfg = workdir / "lora-live.yaml"
        cfg.write_text(proxy_config_yaml(spec, servers, placement, port, admin))
        proxy = spawn("proxy-lora", [PYTHON, "-m", "proxy", "run", "--config", str(cfg), "--workers", "1",
                                     "--log-level", "warning"], workdir)
        url, admin_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}"
        await wait_http(url + "/v1/models", proxy)
        await wait_for_discovery(admin_url, placement)
        load0 = os.getloadavg()
        result = await drive(workload, [url], fleet_spec, {s["name"]: s["url"] + "/metrics" for s in servers},
                             [proxy.pid])
        result.meta["loadavg_before"], result.meta["loadavg_after"] = load0, os.getloadavg()
        if not proxy.alive():
            raise RuntimeError(f"the proxy died during the run:\n{proxy.tail()}")
        result.meta["label"] = "live affinity lora"
        result.meta["config"] = cfg.read_text()
        return result
    finally:
        if proxy is not None:
            proxy.stop()
        fleet.stop()


def replay_config(spec: LoraLiveSpec, placement: Placement) -> ReplayConfig:
    return ReplayConfig(policy="affinity", backends=spec.backends, max_model_len=spec.max_model_len,
                        speed=spec.speed, model=MODEL, seed=spec.seed,
                        placement=tuple(sorted(placement.items())), declare_adapters=not spec.discover)


# ------------------------------------------------------------------------------------------------ shares


def shares(result: RunResult, workload: Workload, backends: Sequence[str]) -> dict[str, Any]:
    """Per backend: share of all answered requests; per model (adapter or `base`): share of its requests."""
    overall: Counter[str] = Counter()
    per_model: dict[str, Counter[str]] = {}
    errors = 0
    for rec in result.records:
        if rec.status != 200 or rec.backend is None:
            errors += 1
            continue
        model = workload.items[rec.index].model or BASE
        overall[rec.backend] += 1
        per_model.setdefault(model, Counter())[rec.backend] += 1

    def norm(c: Counter[str]) -> dict[str, float]:
        n = sum(c.values())
        return {b: (c[b] / n if n else 0.0) for b in backends}

    return {"overall": norm(overall), "per_model": {m: norm(c) for m, c in sorted(per_model.items())},
            "counts": {m: sum(c.values()) for m, c in sorted(per_model.items())}, "errors": errors}


def compare(live: dict[str, Any], rep: dict[str, Any]) -> dict[str, Any]:
    """Absolute differences of every share, and the largest one (overall and per model)."""
    diff_overall = {b: live["overall"][b] - rep["overall"].get(b, 0.0) for b in live["overall"]}
    diff_models: dict[str, dict[str, float]] = {}
    for m in sorted(set(live["per_model"]) | set(rep["per_model"])):
        lm, rm = live["per_model"].get(m, {}), rep["per_model"].get(m, {})
        diff_models[m] = {b: lm.get(b, 0.0) - rm.get(b, 0.0) for b in sorted(set(lm) | set(rm))}
    max_overall = max((abs(v) for v in diff_overall.values()), default=0.0)
    max_model = max((abs(v) for d in diff_models.values() for v in d.values()), default=0.0)
    return {"overall": diff_overall, "per_model": diff_models, "max_overall": max_overall,
            "max_per_model": max_model}


def table(live: dict[str, Any], rep: dict[str, Any], diff: dict[str, Any], backends: Sequence[str]) -> str:
    def row(label: str, lv: dict[str, float], rv: dict[str, float]) -> str:
        cells = [f"{lv.get(b, 0) * 100:.1f} / {rv.get(b, 0) * 100:.1f}" for b in backends]
        worst = max((abs(lv.get(b, 0) - rv.get(b, 0)) for b in backends), default=0.0)
        return f"| {label} | " + " | ".join(cells) + f" | {worst * 100:.1f} |"

    out = ["| requests (live n / replay n) | " + " | ".join(backends) + " | max diff (pt) |",
           "|---|" + "---|" * len(backends) + "---|",
           row(f"all ({sum(live['counts'].values())} / {sum(rep['counts'].values())})", live["overall"], rep["overall"])]
    for m in sorted(set(live["per_model"]) | set(rep["per_model"])):
        out.append(row(f"{m} ({live['counts'].get(m, 0)} / {rep['counts'].get(m, 0)})",
                       live["per_model"].get(m, {}), rep["per_model"].get(m, {})))
    return "\n".join(out)


async def run(spec: LoraLiveSpec, placement: Placement | None = None, workdir: Path | None = None) -> dict[str, Any]:
    """Live, then replay, then the comparison (a JSON-able document)."""
    from loadtest.report import summarize

    placement = placement if placement is not None else default_placement(spec)
    workload = build_workload(spec)
    workdir = workdir or temp_workdir("lora-live-")
    backends = [f"sim-{i}" for i in range(spec.backends)]
    live = await live_run(spec, workload, placement, workdir)
    t0 = time.perf_counter()
    rep = await replay(workload, replay_config(spec, placement))
    replay_wall = time.perf_counter() - t0
    ls, rs = shares(live, workload, backends), shares(rep, workload, backends)
    diff = compare(ls, rs)
    worst = max(diff["max_overall"], diff["max_per_model"])
    lsum, rsum = summarize(live, workload, label="live"), summarize(rep, workload, label="replay")
    return {
        "spec": dataclasses.asdict(spec),
        "placement": {b: list(a) for b, a in placement.items()},
        "workload": workload.summary(),
        "live": ls, "replay": rs, "diff": diff,
        "max_diff": worst, "agree": worst <= spec.tolerance + 1e-12,
        "table": table(ls, rs, diff, backends),
        "live_summary": {k: lsum.get(k) for k in ("requests", "ok", "errors", "ttft_p50", "ttft_p99", "hit_ratio")},
        "replay_summary": {k: rsum.get(k) for k in ("requests", "ok", "errors", "ttft_p50", "ttft_p99", "hit_ratio")},
        "replay_reasons": rep.meta.get("reasons"),
        "replay_wall_s": replay_wall,
        "live_meta": {k: v for k, v in live.meta.items() if k not in ("workload",)},
    }


def markdown(doc: dict[str, Any], command: str) -> str:
    spec = doc["spec"]
    verdict = "**agree**" if doc["agree"] else "**do not agree**"
    lines = [
        "# LoRA workload: replay vs live (issue 14)",
        "",
        f"Command: `{command}`",
        "",
        f"Workload: {doc['workload']['requests']} requests over {doc['workload']['duration_s']:g} s, "
        f"{spec['adapters']} adapters (Zipf; lora-0 hottest), {spec['base_share'] * 100:g}% for the base model; "
        f"{spec['backends']} simulated backends, adapters {'discovered from /v1/models' if spec['discover'] else 'declared per backend'}.",
        "",
        "Placement: " + "; ".join(f"{b}: {', '.join(a) or '–'}" for b, a in doc["placement"].items()),
        "",
        "Each cell: live / replay share of the row's requests on that backend (%).",
        "",
        doc["table"],
        "",
        f"Largest difference: {doc['max_diff'] * 100:.1f} percentage points (overall "
        f"{doc['diff']['max_overall'] * 100:.1f}, per model {doc['diff']['max_per_model'] * 100:.1f}); tolerance "
        f"{spec['tolerance'] * 100:g}: {verdict}. Errors: live {doc['live']['errors']}, replay {doc['replay']['errors']}.",
        "",
        f"Replay decisions by reason: {doc['replay_reasons']}.",
        "",
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m loadtest.lora_live", description=__doc__.split("\n")[0])
    d = LoraLiveSpec()
    ap.add_argument("--requests", type=int, default=d.requests)
    ap.add_argument("--rate", type=float, default=d.rate, help="arrivals per second (Poisson)")
    ap.add_argument("--adapters", type=int, default=d.adapters, help="LoRA adapters lora-0..N-1 (Zipf demand)")
    ap.add_argument("--base-share", type=float, default=d.base_share, help="share of requests for the base model")
    ap.add_argument("--backends", type=int, default=d.backends)
    ap.add_argument("--hot-copies", type=int, default=d.hot_copies, help="backends per hot adapter (default placement)")
    ap.add_argument("--placement", help="BACKEND=ADAPTER+ADAPTER,... instead of the default placement")
    ap.add_argument("--discover", action="store_true", help="do not declare adapters: the proxy discovers them")
    ap.add_argument("--speed", type=float, default=d.speed)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--tolerance", type=float, default=d.tolerance, help="largest share difference that agrees")
    ap.add_argument("--out", type=Path, help="write OUT.md and OUT.json")
    return ap


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(argv if argv is not None else sys.argv[1:])
    args = build_parser().parse_args(argv)
    if args.requests < 1 or args.adapters < 1 or args.backends < 1 or not 0 <= args.base_share <= 1:
        raise SystemExit("--requests, --adapters, --backends must be >= 1 and --base-share in [0, 1]")
    spec = LoraLiveSpec(requests=args.requests, rate=args.rate, adapters=args.adapters, base_share=args.base_share,
                        backends=args.backends, hot_copies=args.hot_copies, discover=args.discover,
                        speed=args.speed, seed=args.seed, tolerance=args.tolerance)
    placement = parse_placement(args.placement) if args.placement else None
    import uvloop

    doc = uvloop.run(run(spec, placement))
    command = "python -m loadtest.lora_live " + " ".join(argv)
    md = markdown(doc, command)
    print(md)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".md").write_text(md)
        args.out.with_suffix(".json").write_text(json.dumps({"command": command, **doc}, indent=1, default=str))
    if not doc["agree"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
