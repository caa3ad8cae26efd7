"""Policy comparison: every routing policy (and the peer routers) against a fresh simulated fleet, same
workload, one report.

    python -m loadtest.compare --policies round_robin,least_request,least_load,affinity \\
        --peers sglang:round_robin,sglang:cache_aware,vllm:round_robin,vllm:cache_aware \\
        --workload mooncake --window 0:150 --speed 0.8 --backends 4 --out loadtest/results/mooncake-4xh100

For each column: start a fleet (its own process, cold caches), start the router (the proxy as
`python -m proxy run --config` with the policy, or a peer from peers-venv), drive the workload open-loop
through it while sampling every backend's /metrics each second, stop both. The report puts the design's
load-balancing table next to ours and checks the affinity policy against its targets. With --replay the
same window is also replayed offline (loadtest.replay) for each of our policies, and the live-vs-replay
difference is tabulated.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from loadtest.harness import FleetSpec, Proc, start_fleet_process, start_proxy_process, temp_workdir
from loadtest.peers import Peer, parse_peers, start_peer
from loadtest.report import design_comparison, summarize, write_report
from loadtest.replay import parse_profile_sets
from loadtest.records import RunConfig, RunResult
from loadtest.run import add_workload_args, prepare_workload, run_workload
from loadtest.workloads import Workload

def target_check(summaries: Sequence[dict[str, Any]]) -> str:
    by = {s["label"]: s for s in summaries}
    a = by.get("affinity")
    if a is None:
        return "The affinity policy was not part of this run; no target check.\n"
    rows = ["| target | measured | met |", "|---|---|---|"]

    def row(name: str, measured: str, ok: bool | None) -> None:
        rows.append(f"| {name} | {measured} | {'–' if ok is None else ('yes' if ok else '**no**')} |")

    hit, lru, inf = a["hit_ratio"], a["bound_lru"], a["bound_inf"]
    if hit is not None and inf:
        row("hit ratio >= 90% of the one-cache bound (infinite cache)", f"{hit * 100:.1f}% / {inf * 100:.1f}% = {hit / inf * 100:.0f}%", hit >= 0.9 * inf)
    if hit is not None and lru:
        row("hit ratio >= 90% of the one-cache bound (one LRU cache of the fleet's KV size)", f"{hit * 100:.1f}% / {lru * 100:.1f}% = {hit / lru * 100:.0f}%", hit >= 0.9 * lru)
    rr = by.get("round_robin")
    if rr and rr["ttft_p99"] and a["ttft_p99"]:
        row("p99 TTFT <= half of round robin's", f"{a['ttft_p99'] * 1000:.0f} ms vs {rr['ttft_p99'] * 1000:.0f} ms (ratio {a['ttft_p99'] / rr['ttft_p99']:.2f})", a["ttft_p99"] <= 0.5 * rr["ttft_p99"])
    for label, s in by.items():
        if "cache_aware" in label and s["ttft_p99"] and a["ttft_p99"]:
            row(f"p99 TTFT below {label}", f"{a['ttft_p99'] * 1000:.0f} ms vs {s['ttft_p99'] * 1000:.0f} ms", a["ttft_p99"] < s["ttft_p99"])
    if a["gpu_util_std"] is not None:
        row("GPU utilisation std-dev < 5 points (per 10 s window, averaged)", f"{a['gpu_util_std'] * 100:.1f} points", a["gpu_util_std"] < 0.05)
    if a.get("gpu_util_std_whole_run") is not None:
        w = a["gpu_util_std_whole_run"]
        row("GPU utilisation std-dev < 5 points (whole run)", f"{w * 100:.1f} points", w < 0.05)
    return "\n".join(rows) + "\n"


def replay_agreement(live: Sequence[dict[str, Any]], replayed: Sequence[dict[str, Any]]) -> str:
    rows = [
        "| policy | TTFT p50 live / replay (ms) | TTFT p99 live / replay (ms) | hit ratio live / replay | GPU util mean live / replay | GPU util std live / replay (pts) |",
        "|---|---|---|---|---|---|",
    ]
    by = {s["label"].replace("replay ", ""): s for s in replayed}
    for s in live:
        r = by.get(s["label"])
        if r is None:
            continue

        def ms(x: float | None) -> str:
            return "–" if x is None else f"{x * 1000:.0f}"

        def pc(x: float | None) -> str:
            return "–" if x is None else f"{x * 100:.1f}%"

        def pts(x: float | None) -> str:
            return "–" if x is None else f"{x * 100:.1f}"

        rows.append(
            f"| {s['label']} | {ms(s['ttft_p50'])} / {ms(r['ttft_p50'])} | {ms(s['ttft_p99'])} / {ms(r['ttft_p99'])} | "
            f"{pc(s['hit_ratio'])} / {pc(r['hit_ratio'])} | {pc(s['gpu_util_mean'])} / {pc(r['gpu_util_mean'])} | "
            f"{pts(s['gpu_util_std'])} / {pts(r['gpu_util_std'])} |"
        )
    return "\n".join(rows) + "\n"


async def run_target(
    label: str, workload: Workload, args: argparse.Namespace, workdir: Path, *, policy: str | None = None,
    peer: Peer | None = None,
) -> RunResult:
    fleet = await start_fleet_process(
        FleetSpec(backends=args.backends, profile=args.profile, max_model_len=args.max_model_len, seed=args.seed,
                  profile_sets=tuple(args.profile_set)),
        workdir,
    )
    router: Proc | None = None
    try:
        servers = fleet.info["servers"]
        if peer is not None:
            router = await start_peer(peer, [s["url"] for s in servers], workdir)
        else:
            assert policy is not None
            router = await start_proxy_process(policy, servers, workdir, epsilon=args.epsilon)
        cfg = RunConfig(url=router.info["url"], model="llama3-8b", speed=args.speed, label=label,
                        progress=not args.no_progress, timeout_s=args.timeout)
        load0 = os.getloadavg()
        t0 = time.process_time()
        result = await run_workload(
            workload, cfg, metrics_urls={s["name"]: s["url"] + "/metrics" for s in servers}, proxy_pids=[router.pid],
        )
        result.meta["loadgen_cpu_s"] = time.process_time() - t0
        result.meta["loadavg_before"] = load0
        result.meta["loadavg_after"] = os.getloadavg()
        result.meta["router"] = {"policy": policy, "peer": peer.label if peer else None, **router.info}
        result.meta["sim_profile"] = fleet.info.get("profile")
        return result
    finally:
        if router is not None:
            router.stop()
        fleet.stop()


async def compare(args: argparse.Namespace, argv: Sequence[str]) -> Path:
    workload = prepare_workload(args)
    out: Path = args.out
    (out / "runs").mkdir(parents=True, exist_ok=True)
    workdir = temp_workdir("compare-")
    targets: list[tuple[str, str | None, Peer | None]] = [(p, p, None) for p in filter(None, args.policies.split(","))]
    targets += [(peer.label, None, peer) for peer in parse_peers(args.peers or "")]
    summaries = []
    for label, policy, peer in targets:
        saved = out / "runs" / f"{label.replace(' ', '_')}.json"
        if args.rebuild:
            if not saved.exists():
                summaries.append({"label": label, "failed": f"no saved run {saved}"})
                continue
            result = RunResult.load(saved)
        else:
            print(f"== {label}", file=sys.stderr, flush=True)
            try:
                result = await run_target(label, workload, args, workdir, policy=policy, peer=peer)
            except RuntimeError as exc:
                print(f"{label}: failed: {exc}", file=sys.stderr)
                summaries.append({"label": label, "failed": str(exc)[:500]})
                continue
            result.save(saved)
        s = summarize(result, workload, label=label)
        summaries.append(s)
        print(
            f"{label}: TTFT p50 {(s['ttft_p50'] or 0) * 1000:.0f} ms p99 {(s['ttft_p99'] or 0) * 1000:.0f} ms, hit "
            f"{(s['hit_ratio'] or 0) * 100:.1f}%, util {(s['gpu_util_mean'] or 0) * 100:.0f}% std "
            f"{(s['gpu_util_std'] or 0) * 100:.1f} pts, errors {s['errors']}",
            file=sys.stderr, flush=True,
        )
    ok = [s for s in summaries if "failed" not in s]
    failed = [s for s in summaries if "failed" in s]

    replayed: list[dict[str, Any]] = []
    if args.replay:
        import asyncio

        from loadtest.replay import ReplayConfig, replay

        for label, policy, peer in targets:
            if policy is None:
                continue
            rc = ReplayConfig(policy=policy, backends=args.backends, profile=args.profile,
                              max_model_len=args.max_model_len, speed=args.speed, model="llama3-8b",
                              profile_overrides=tuple(parse_profile_sets(args.profile_set).items()),
                              epsilon=args.epsilon, seed=args.seed)
            t0 = time.perf_counter()
            r = await replay(workload, rc)
            rs = summarize(r, workload, label=f"replay {policy}")
            rs["replay_wall_s"] = time.perf_counter() - t0
            replayed.append(rs)
        await asyncio.sleep(0)

    from loadtest.replay import isolated_ttfts, make_profile
    from loadtest.stats import percentile

    floor = isolated_ttfts(workload, make_profile(args.profile, args.max_model_len, parse_profile_sets(args.profile_set)))
    floor_line = (
        f"TTFT floor of this window (each prompt alone on an idle {args.profile} with an empty cache, from the "
        f"simulator's engine model): p50 {(percentile(floor, 50) or 0) * 1000:.0f} ms, p99 "
        f"{(percentile(floor, 99) or 0) * 1000:.0f} ms, max {max(floor or [0]) * 1000:.0f} ms. No router gets the p99 "
        "below this except through cache hits on the longest prompts."
    )
    command = "python -m loadtest.compare " + " ".join(shlex.quote(a) for a in argv if a != "--rebuild")
    preface = (
        f"Command: `{command}`\n\n"
        f"Fleet: {args.backends} simulated `{args.profile}` servers (max_model_len {args.max_model_len}"
        f"{', ' + ', '.join(args.profile_set) if args.profile_set else ''}), a fresh fleet "
        f"(cold caches) per column; open loop at --speed {args.speed}. Machine: 2 shared cores; numbers are from one run "
        f"each, so compare ratios, not absolutes. Load average before/after each run is in report.json (meta)."
    )
    appendix = [
        "## The design's table next to ours", "", design_comparison(ok),
        "## Affinity policy vs. its targets", "", floor_line, "", target_check(ok),
    ]
    if replayed:
        appendix += ["## Live vs. offline replay (same window, same policies)", "", replay_agreement(ok, replayed)]
    if failed:
        appendix += ["## Columns that failed", ""] + [f"- {s['label']}: {s['failed']}" for s in failed]
    path = write_report(ok, out, title=f"policy comparison: {workload.name}", workload=workload, preface=preface,
                        appendix="\n".join(appendix))
    if replayed:
        (out / "replay.json").write_text(json.dumps(replayed, indent=1, default=str))
    print(path)
    return path


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(argv if argv is not None else sys.argv[1:])
    ap = argparse.ArgumentParser(prog="python -m loadtest.compare", description=__doc__.split("\n")[0])
    add_workload_args(ap)
    ap.add_argument("--policies", default="round_robin,least_request,least_load,affinity")
    ap.add_argument("--peers", default="", help="e.g. sglang:round_robin,sglang:cache_aware,vllm:round_robin,vllm:cache_aware (needs `python -m loadtest.peers install`)")
    ap.add_argument("--backends", type=int, default=4)
    ap.add_argument("--profile", default="llama3-8b-h100")
    ap.add_argument("--max-model-len", type=int, default=131072, help="simulated context limit (Llama-3.1-8B: 131072)")
    ap.add_argument("--profile-set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a simulator profile field for the fleet and the replays, e.g. mfu_prefill=0.55")
    ap.add_argument("--speed", type=float, default=1.0)
    ap.add_argument("--epsilon", type=float, default=None, help="affinity bounded-load epsilon (default: the proxy's)")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--replay", action="store_true", help="also replay the same window offline and tabulate the difference")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--rebuild", action="store_true", help="rebuild the report from the runs saved in --out/runs (no live runs)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    import uvloop

    uvloop.run(compare(args, argv))


if __name__ == "__main__":
    main()
