"""Live scale-out check (issue 13): R separate proxy replicas in front of one simulated fleet with KV events,
a client spreading requests over them at random (as a Kubernetes Service does), next to the offline replay
of the same window with `--replicas R`.

    python -m loadtest.live_replicas --workload /work/shared/traces/mooncake_synthetic_trace.jsonl \\
        --window 0:120 --speed 0.6 --backends 4 --replicas 2 --index precise,learned \\
        --out loadtest/results/tmp/scaleout-live.json

For each index mode: a fresh fleet (`python -m sim`, its own process, cold caches, real time; with
`precise` every server publishes vLLM-style KV events on ZeroMQ with a replay socket, with `learned` it
publishes nothing), R `python -m proxy run --workers 1` processes, each with its own config naming the same
backends (and, for `precise`, `telemetry.kv_events` for every backend with the simulator's tokenizer
folder), then the workload open-loop, each request to a random replica (seeded), while every backend's
/metrics is sampled once a second. Then `loadtest.replay` runs the same window, speed, fleet and policy
settings in virtual time with `replicas=R` and the same index and load view, and a table gives live, replay
and live / replay for hit ratio, TTFT mean / p90 / p99 and GPU busy.

The load view follows loadtest/results/scaleout.md: `engines` (`routing.shared_backends: true`, what that
study picked for precise events) with `precise`, `own` (the default) with `learned`, unless `--load-view`
says otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import re
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import aiohttp

from loadtest.fleet_sampler import FleetSampler
from loadtest.harness import PYTHON, Proc, free_port, spawn, temp_workdir, wait_http
from loadtest.records import Record, RunConfig, RunResult
from loadtest.replay import INDEXES, LOAD_VIEWS, ReplayConfig, replay
from loadtest.run import _one, add_workload_args, prepare_workload, process_cpu_seconds
from loadtest.workloads import Workload
from sim.tokenizer import TOKENIZER_DIR

MODEL = "llama3-8b"
_SERVER_LINE = re.compile(r"^(?P<name>\S+) (?P<url>http://\S+)(?P<rest>.*)$")


@dataclass(frozen=True)
class LiveSpec:
    backends: int = 4
    replicas: int = 2
    workers: int = 1  # `run --workers W` per replica (the replay: W workers sharing a host's load block)
    index: str = "precise"
    load_view: str = "engines"
    # routing.policy of every replica and of the replay. round_robin is the calibration run: it reads no index
    # and no load, so at R = 1 live and replay place every request alike and what differs is the fleet's time.
    policy: str = "affinity"
    max_model_len: int | None = 131072
    speed: float = 1.0
    seed: int = 0
    timeout_s: float = 600.0
    progress: bool = False
    # Diagnostic: the proxy's tokenizer offload threshold (ModelTokenizer.offload_chars). None: the proxy's
    # own default, under which a prompt with more uncached text than that is routed by the learned index on
    # that sighting (tokenised off the loop for the next). The replay tokenises every prompt inline.
    offload_chars: int | None = None
    # telemetry.kv_events.drain_interval_ms of every replica (None: the proxy's default).
    drain_interval_ms: int | None = None
    # load_view "peers": the redis-server the replicas share their load through (routing.peer_load).
    redis_url: str | None = None
    peer_refresh_ms: int = 10  # routing.peer_load.refresh_ms's default


LIVE_POLICIES = ("affinity", "round_robin")


def default_load_view(index: str) -> str:
    return "engines" if index == "precise" else "own"


# ------------------------------------------------------------------------------------------------ processes


async def start_sim_fleet(spec: LiveSpec, workdir: Path) -> Proc:
    """`python -m sim` with KV events on (precise) or off (learned); info["servers"] lists name/url/kv."""
    argv = [PYTHON, "-m", "sim", "--servers", str(spec.backends), "--port", "0", "--model-name", MODEL,
            "--seed", str(spec.seed)]
    if spec.max_model_len:
        argv += ["--max-model-len", str(spec.max_model_len)]
    if spec.index == "precise":
        argv += ["--kv-events-endpoint", "tcp://127.0.0.1:*", "--kv-events-replay-endpoint", "tcp://127.0.0.1:*"]
    proc = spawn(f"sim-{spec.index}", argv, workdir)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"simulator exited:\n{proc.tail()}")
        servers = []
        for line in proc.log.read_text(errors="replace").splitlines():
            m = _SERVER_LINE.match(line)
            if not m:
                continue
            extra = dict(kv.split("=", 1) for kv in m["rest"].split() if "=" in kv)
            servers.append({"name": m["name"], "url": m["url"], "kv_events": extra.get("kv_events"),
                            "kv_replay": extra.get("kv_replay")})
        if len(servers) == spec.backends:
            proc.info = {"servers": servers}
            for s in servers:
                await wait_http(s["url"] + "/health", proc)
            return proc
        await asyncio.sleep(0.2)
    proc.stop()
    raise RuntimeError(f"simulator did not start:\n{proc.tail()}")


def replica_config_yaml(spec: LiveSpec, servers: Sequence[dict[str, Any]], port: int, admin_port: int) -> str:
    """One replica's config: the replay's policy settings (the proxy's defaults, affinity), the same backends."""
    lines = [
        f"listen: {{host: 127.0.0.1, port: {port}}}",
        f"admin: {{host: 127.0.0.1, port: {admin_port}}}",
        "debug_headers: true",
        "routing:",
        f"  policy: {spec.policy}",
        f"  seed: {spec.seed}",
        f"  shared_backends: {'true' if spec.load_view in ('engines', 'peers') else 'false'}",
    ]
    if spec.load_view == "peers":  # the other replicas' load through Redis; the engines' counts as its fallback
        if not spec.redis_url:
            raise RuntimeError("load view peers needs a redis-server (LiveSpec.redis_url)")
        lines.append(f"  peer_load: {{redis_url: '{spec.redis_url}', refresh_ms: {spec.peer_refresh_ms}}}")
    lines.append("backends:")
    lines += [f"  - {{name: {s['name']}, url: '{s['url']}', models: ['{MODEL}']}}" for s in servers]
    if spec.index == "precise":
        lines += ["telemetry:", "  kv_events:", f"    tokenizers: {{'{MODEL}': '{TOKENIZER_DIR}'}}", "    backends:"]
        for s in servers:
            if not s.get("kv_events"):
                raise RuntimeError(f"{s['name']} publishes no KV events (simulator output lacks kv_events=)")
            replay_ep = f", replay_endpoint: '{s['kv_replay']}'" if s.get("kv_replay") else ""
            lines.append(f"      {s['name']}: {{endpoint: '{s['kv_events']}'{replay_ep}}}")
        if spec.drain_interval_ms is not None:
            lines.append(f"    drain_interval_ms: {int(spec.drain_interval_ms)}")
    return "\n".join(lines) + "\n"


async def start_replicas(spec: LiveSpec, servers: Sequence[dict[str, Any]], workdir: Path) -> list[Proc]:
    procs: list[Proc] = []
    try:
        for r in range(spec.replicas):
            port, admin = free_port(), free_port()
            cfg = workdir / f"replica-{spec.index}-{r}.yaml"
            cfg.write_text(replica_config_yaml(spec, servers, port, admin))
            run = ["run", "--config", str(cfg), "--workers", str(spec.workers), "--log-level", "warning"]
            if spec.offload_chars is None:
                argv = [PYTHON, "-m", "proxy", *run]
            else:  # the same entry point with the tokenizer's threshold changed, for the diagnostic
                argv = [PYTHON, "-c", "import sys; import proxy.dataplane.tokenize as t; "
                        f"t.ModelTokenizer.__init__.__kwdefaults__['offload_chars'] = {int(spec.offload_chars)}; "
                        "from proxy.cli import main; sys.argv[0] = 'affinity-proxy'; sys.exit(main())", *run]
            proc = spawn(f"replica-{spec.index}-{r}", argv, workdir)
            proc.info = {"url": f"http://127.0.0.1:{port}", "admin": f"http://127.0.0.1:{admin}", "config": str(cfg)}
            procs.append(proc)
        for proc in procs:
            await wait_http(proc.info["url"] + "/v1/models", proc)
    except BaseException:
        for proc in procs:
            proc.stop()
        raise
    return procs


async def replica_metrics(admin_url: str) -> dict[str, Any]:
    """What one replica's admin /metrics (merged over its workers) says about its routing after a run:
    `kv_index_blocks` per backend ({} without KV events), `reasons` (routing decisions by reason, to set
    beside the replay's), and `precise_wait` (the precise lookup's waits for a long prompt's tokenisation:
    how many, seconds in all, how many ran into precise_wait_ms, how many did not wait because
    precise_wait_concurrency were running; the last two were routed by the learned index), and `loop_lag`
    (every process's event-loop lag samples, every 100 ms: how many, their sum, how many over 5 ms, the
    longest)."""
    from prometheus_client.parser import text_string_to_metric_families

    async with aiohttp.ClientSession() as s:
        async with s.get(admin_url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as resp:
            text = await resp.text()
    blocks: dict[str, float] = {}
    reasons: dict[str, int] = {}
    wait = {"waits": 0, "wait_s": 0.0, "timeouts": 0, "skipped": 0}
    lag = {"samples": 0, "lag_s": 0.0, "over_5ms": 0, "max_s": 0.0}
    upto_5ms = 0.0
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            name, labels, value = sample.name, sample.labels, sample.value
            if name == "affinity_proxy_kv_index_blocks":
                blocks[labels["backend"]] = value
            elif name == "affinity_proxy_routing_decisions_total":
                reasons[labels["reason"]] = reasons.get(labels["reason"], 0) + int(value)
            elif name == "affinity_proxy_precise_wait_seconds_count":
                wait["waits"] = int(value)
            elif name == "affinity_proxy_precise_wait_seconds_sum":
                wait["wait_s"] = value
            elif name == "affinity_proxy_precise_wait_timeouts_total":
                wait["timeouts"] = int(value)
            elif name == "affinity_proxy_precise_wait_skipped_total":
                wait["skipped"] = int(value)
            elif name == "affinity_proxy_event_loop_lag_seconds_count":
                lag["samples"] = int(value)
            elif name == "affinity_proxy_event_loop_lag_seconds_sum":
                lag["lag_s"] = value
            elif name == "affinity_proxy_event_loop_lag_seconds_bucket" and labels.get("le") == "0.005":
                upto_5ms = value
            elif name == "affinity_proxy_event_loop_lag_max_seconds":
                lag["max_s"] = max(lag["max_s"], value)
    lag["over_5ms"] = int(lag["samples"] - upto_5ms)
    return {"kv_index_blocks": blocks, "reasons": reasons, "precise_wait": wait, "loop_lag": lag}


# ------------------------------------------------------------------------------------------------ driving


async def drive(workload: Workload, urls: Sequence[str], spec: LiveSpec,
                metrics_urls: dict[str, str], proxy_pids: Sequence[int]) -> RunResult:
    """Open loop at the trace's times / speed; each request to a random one of `urls` (seeded)."""
    text = workload.text()
    cfgs = [RunConfig(url=u, model=MODEL, speed=spec.speed, timeout_s=spec.timeout_s, progress=False, label=u)
            for u in urls]
    rng = random.Random(spec.seed ^ 0x5CA1E0)
    records: list[Record] = []
    chosen: list[int] = []
    sampler = FleetSampler(metrics_urls)
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None, enable_cleanup_closed=True)
    timeout = aiohttp.ClientTimeout(total=spec.timeout_s, sock_connect=10.0)
    cpu0 = process_cpu_seconds(proxy_pids)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False) as session:
        await sampler.start()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        wall0 = time.monotonic()
        late = 0.0

        async def fire(i: int, cfg: RunConfig, scheduled: float) -> None:
            records.append(await _one(session, cfg, workload.items[i], i, text, t0, scheduled))

        tasks = []
        for i, item in enumerate(workload.items):
            due = t0 + item.t / spec.speed
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                late = max(late, -delay)
            r = rng.randrange(len(cfgs))
            chosen.append(r)
            tasks.append(asyncio.create_task(fire(i, cfgs[r], item.t / spec.speed)))
            if spec.progress and i % 50 == 0:
                print(f"  sent {i}/{len(workload.items)} at {loop.time() - t0:.0f} s", file=sys.stderr, flush=True)
        await asyncio.gather(*tasks)
        wall = loop.time() - t0
        await sampler.stop()
    cpu1 = process_cpu_seconds(proxy_pids)
    records.sort(key=lambda r: r.index)
    samples = [{**s, "t": s["t"] - wall0} for s in sampler.samples]
    meta = {
        "label": f"live {spec.policy} R{spec.replicas}xW{spec.workers} {spec.index} load {spec.load_view}",
        "mode": "open",
        "speed": spec.speed,
        "model": MODEL,
        "workload": workload.summary(),
        "replica_share": [chosen.count(r) for r in range(len(cfgs))],
        "max_send_lateness_s": late,
        "started_unix": time.time() - wall,
    }
    cpu = (cpu1 - cpu0) if cpu0 is not None and cpu1 is not None else None
    return RunResult(meta, records, samples, sampler.capacity_tokens, wall, cpu)


async def start_redis(workdir: Path) -> tuple[Proc, str]:
    """A redis-server without persistence on a free loopback port (load view peers); its URL."""
    import shutil
    import socket

    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("--load-view peers needs redis-server (apt-get install -y redis-server)")
    port = free_port()
    proc = spawn("redis", [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                 workdir)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"redis-server exited:\n{proc.tail()}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as c:
                c.sendall(b"PING\r\n")
                if c.recv(16).startswith(b"+PONG"):
                    return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            pass
        await asyncio.sleep(0.1)
    proc.stop()
    raise RuntimeError("redis-server did not answer")


async def live_run(workload: Workload, spec: LiveSpec, workdir: Path) -> RunResult:
    redis_proc: Proc | None = None
    if spec.load_view == "peers" and spec.redis_url is None:
        redis_proc, url = await start_redis(workdir)
        spec = replace(spec, redis_url=url)
    fleet = await start_sim_fleet(spec, workdir)
    replicas: list[Proc] = []
    try:
        servers = fleet.info["servers"]
        replicas = await start_replicas(spec, servers, workdir)
        if spec.index == "precise":
            await asyncio.sleep(1.0)  # SUB sockets connect (what they miss meanwhile comes back by replay)
        load0 = os.getloadavg()
        result = await drive(workload, [p.info["url"] for p in replicas], spec,
                             {s["name"]: s["url"] + "/metrics" for s in servers}, [p.pid for p in replicas])
        result.meta["loadavg_before"] = load0
        result.meta["loadavg_after"] = os.getloadavg()
        result.meta["replicas"] = [p.info for p in replicas]
        scraped = [await replica_metrics(p.info["admin"]) for p in replicas]
        for key in ("kv_index_blocks", "reasons", "precise_wait", "loop_lag"):
            result.meta[key] = [m[key] for m in scraped]  # one entry per replica
        for p in replicas:
            if not p.alive():
                raise RuntimeError(f"{p.name} died during the run:\n{p.tail()}")
        return result
    finally:
        for p in replicas:
            p.stop()
        fleet.stop()
        if redis_proc is not None:
            redis_proc.stop()


def replay_config(spec: LiveSpec, kv_event_delay_ms: float) -> ReplayConfig:
    return ReplayConfig(policy=spec.policy, backends=spec.backends, max_model_len=spec.max_model_len,
                        speed=spec.speed, model=MODEL, seed=spec.seed, replicas=spec.replicas,
                        workers=spec.workers,
                        # a live --workers replica is the shared-memory host (without peer load too)
                        host_table=spec.workers > 1,
                        index=spec.index, kv_event_delay_ms=kv_event_delay_ms, load_view=spec.load_view,
                        peer_refresh_ms=float(spec.peer_refresh_ms),
                        # the proxy's precise lookup as the live replicas run it: their own offload threshold
                        # (a diagnostic threshold past every prompt is the inline lookup; the replay models
                        # only these two, the proxy default and no offloading)
                        precise_lookup="proxy" if spec.offload_chars is None or spec.offload_chars < 2**31 else "inline")


# ------------------------------------------------------------------------------------------------ table

ROWS = (
    ("hit ratio", "hit_ratio", "pct"),
    ("hit ratio (of the fleet-size LRU bound)", "hit_vs_bound", "pct"),
    ("TTFT mean", "ttft_mean", "ms"),
    # Live: the engines' own TTFT histograms (the proxy's path taken out); the replay's TTFT is the engines'
    # by construction (no time is spent between client and engine in virtual time).
    ("TTFT mean at the engines", "engine_ttft_mean", "ms"),
    ("TTFT p50", "ttft_p50", "ms"),
    ("TTFT p90", "ttft_p90", "ms"),
    ("TTFT p99", "ttft_p99", "ms"),
    ("GPU busy (mean)", "gpu_util_mean", "pct"),
    ("errors", "errors", "n"),
)


def _fmt(v: float | None, kind: str) -> str:
    if v is None:
        return "–"
    if kind == "pct":
        return f"{v * 100:.2f}%"
    if kind == "ms":
        return f"{v * 1000:,.0f} ms"
    return f"{v:g}"


# The replay's summary key a ROWS key is compared with, where they differ.
REPLAY_KEY = {"engine_ttft_mean": "ttft_mean"}


def replay_value(rep: dict[str, Any], key: str) -> Any:
    """What the replay's summary says for the ROWS key `key`."""
    return rep.get(REPLAY_KEY.get(key, key))


def ratio(live: float | None, rep: float | None) -> float | None:
    if live is None or rep is None or rep == 0:
        return None
    return live / rep


def side_by_side(pairs: Sequence[tuple[str, dict[str, Any], dict[str, Any]]], tolerance: float = 0.10) -> str:
    """One markdown table per (title, live summary, replay summary): live | replay | live / replay."""
    out = []
    for title, live, rep in pairs:
        out += [f"**{title}**", "", "| | live | replay | live / replay | within ±10% |", "|---|---|---|---|---|"]
        for name, key, kind in ROWS:
            rv = replay_value(rep, key)
            r = ratio(live.get(key), rv) if kind != "n" else None
            within = "–" if r is None else ("yes" if abs(r - 1) <= tolerance else "**no**")
            out.append(f"| {name} | {_fmt(live.get(key), kind)} | {_fmt(rv, kind)} | "
                       f"{'–' if r is None else f'{r:.2f}'} | {within} |")
        if live.get("sim_late_mean_ms") is not None:
            out += ["", f"Live, the simulated engines' steps went out {live['sim_late_mean_ms']:.1f} ms late on average "
                        f"(at most {live['sim_late_max_ms']:,.0f} ms) against their model: the machine's CPU, which the "
                        "live latencies carry and the replay's do not."]
        if live.get("ttft_added_mean_ms") is not None:
            out += ["", f"Live, the engines' own TTFT mean was {1000 * live['engine_ttft_mean']:,.0f} ms; the client saw "
                        f"{live['ttft_added_mean_ms']:.1f} ms more on average (the proxy: routing, tokenisation "
                        "waits, forwarding)."]
            if live.get("e2e_added_mean_ms") is not None:
                out[-1] += (f" To the answer's end: {live['e2e_added_mean_ms']:.1f} ms more than the engines' e2e "
                            f"({1000 * live['engine_e2e_mean']:,.0f} ms).")
        out.append("")
    return "\n".join(out)


def brief(s: dict[str, Any]) -> dict[str, Any]:
    keys = ("label", "requests", "ok", "errors", "hit_ratio", "hit_vs_bound", "bound_lru", "client_hit_ratio",
            "ttft_mean", "ttft_p50", "ttft_p90", "ttft_p99", "gpu_util_mean", "backend_share", "proxy_cpu_us_per_req",
            "wall_s", "sim_late_mean_ms", "sim_late_max_ms", "engine_ttft_mean", "ttft_added_mean_ms",
            "engine_e2e_mean", "e2e_added_mean_ms")
    return {k: s.get(k) for k in keys}


async def main_async(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    from loadtest.report import summarize

    workload = prepare_workload(args)
    if not workload.items:
        raise SystemExit("the workload is empty (check --window/--limit)")
    workdir = temp_workdir("live-replicas-")
    results: list[dict[str, Any]] = []
    pair_records: list[dict[str, Any]] = []
    pairs = []
    for index in filter(None, (x.strip() for x in args.index.split(","))):
        if index not in INDEXES:
            raise SystemExit(f"--index: unknown {index!r}; known: {', '.join(INDEXES)}")
        spec = LiveSpec(backends=args.backends, replicas=args.replicas, workers=args.workers, index=index,
                        load_view=args.load_view or default_load_view(index), max_model_len=args.max_model_len,
                        speed=args.speed, seed=args.seed, timeout_s=args.timeout, progress=not args.no_progress,
                        offload_chars=args.proxy_offload_chars, policy=args.policy,
                        drain_interval_ms=args.proxy_drain_interval_ms)
        print(f"== live: {spec}", file=sys.stderr, flush=True)
        live = await live_run(workload, spec, workdir)
        ls = summarize(live, workload, label=live.meta["label"])
        print(f"== replay: replicas {spec.replicas}, {index}, load {spec.load_view}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        rep = await replay(workload, replay_config(spec, args.kv_event_delay_ms))
        rs = summarize(rep, workload, label=f"replay {spec.policy} R{spec.replicas}xW{spec.workers} {index} load {spec.load_view}")
        rs["replay_wall_s"] = time.perf_counter() - t0
        title = f"{spec.policy}, {spec.replicas} replicas x {spec.workers} workers, {index} index, load view {spec.load_view}"
        print(routing_line(live.meta, rep.meta), file=sys.stderr, flush=True)
        pairs.append((title, ls, rs))
        if args.records is not None:
            pair_records.append({"spec": spec.__dict__, "live": [dataclasses.asdict(r) for r in live.records],
                                 "replay": [dataclasses.asdict(r) for r in rep.records]})
        results.append({
            "spec": spec.__dict__, "live": brief(ls), "replay": brief(rs),
            "live_meta": {k: v for k, v in live.meta.items() if k != "workload"},
            "replay_reasons": rep.meta.get("reasons"),
            "ratios": {key: ratio(ls.get(key), replay_value(rs, key)) for _, key, kind in ROWS if kind != "n"},
        })
    table = side_by_side(pairs)
    print(table)
    doc = {"command": "python -m loadtest.live_replicas " + " ".join(argv), "workload": workload.summary(),
           "runs": results, "table": table, "workdir": str(workdir)}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1, default=str))
    if args.records is not None:
        args.records.parent.mkdir(parents=True, exist_ok=True)
        args.records.write_text(json.dumps(pair_records, default=str))
        print(tail_table(pair_records), file=sys.stderr)
    return doc


def routing_line(live_meta: dict[str, Any], replay_meta: dict[str, Any]) -> str:
    """Decisions by reason, live (summed over replicas) beside the replay, and the live precise waits: where
    a gap in hits between the two comes from (a long prompt whose wait timed out is routed by the learned
    index live, precisely in the replay, which tokenises without taking time)."""
    live: dict[str, int] = {}
    for per in live_meta.get("reasons", []):
        for k, n in per.items():
            live[k] = live.get(k, 0) + n
    rep = replay_meta.get("reasons") or {}
    keys = sorted(set(live) | set(rep), key=lambda k: -(live.get(k, 0) + rep.get(k, 0)))
    parts = [f"{k} {live.get(k, 0)}/{rep.get(k, 0)}" for k in keys]
    waits = live_meta.get("precise_wait", [])
    w = {k: sum(x[k] for x in waits) for k in ("waits", "wait_s", "timeouts", "skipped")} if waits else None
    line = "reasons live/replay: " + (", ".join(parts) or "-")
    if w:
        mean = w["wait_s"] / w["waits"] * 1e3 if w["waits"] else 0.0
        line += (f"; live precise waits {w['waits']} (mean {mean:.0f} ms), timed out {w['timeouts']}, "
                 f"skipped at the concurrency cap {w['skipped']}")
    lags = live_meta.get("loop_lag", [])
    n = sum(x["samples"] for x in lags)
    if n:
        line += (f"; event-loop lag mean {sum(x['lag_s'] for x in lags) / n * 1e3:.1f} ms, "
                 f"{sum(x['over_5ms'] for x in lags) / n:.1%} of samples over 5 ms, "
                 f"max {max(x['max_s'] for x in lags) * 1e3:.0f} ms")
    return line


def tail_table(pair_records: Sequence[dict[str, Any]], top: int = 8) -> str:
    """Per request, live against replay, for the `top` slowest first tokens of the live run: where a
    percentile of a few hundred requests comes from (p99 of 427 is the 5th slowest). Same request index
    on both sides (the replay sends the same workload in the same order)."""
    out = []
    for pr in pair_records:
        rep = {r["index"]: r for r in pr["replay"]}
        live = sorted((r for r in pr["live"] if r["ttft"] is not None), key=lambda r: -r["ttft"])[:top]
        out.append(f"{pr['spec']['index']}: the {top} slowest first tokens live, and the same requests in the replay")
        out.append("| request | input tokens | live TTFT ms | replay TTFT ms | live / replay | live backend | replay backend "
                   "| cached live / replay |")
        out.append("|---|---|---|---|---|---|---|---|")
        for r in live:
            q = rep.get(r["index"], {})
            qt = q.get("ttft")
            ttft = r["ttft"]
            rep_ms = "-" if qt is None else f"{qt * 1e3:,.0f}"
            ratio_ = "-" if not qt else f"{ttft / qt:.2f}"
            out.append(f"| {r['index']} | {r['input_tokens']} | {ttft * 1e3:,.0f} | {rep_ms} | {ratio_} | "
                       f"{r['backend']} | {q.get('backend')} | {r['cached_tokens']} / {q.get('cached_tokens')} |")
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m loadtest.live_replicas", description=__doc__.split("\n")[0])
    add_workload_args(ap)
    ap.add_argument("--speed", type=float, default=1.0, help="time compression of the arrivals (as loadtest.run)")
    ap.add_argument("--backends", type=int, default=4)
    ap.add_argument("--replicas", type=int, default=2, help="separate `proxy run` processes; each request to a random one")
    ap.add_argument("--workers", type=int, default=1, help="`run --workers W` per replica (the replay: --workers W)")
    ap.add_argument("--policy", choices=LIVE_POLICIES, default="affinity",
                    help="routing.policy of the replicas and the replay; round_robin (with --index learned) places "
                         "requests alike live and in the replay at R = 1: the calibration of the fleet's own time")
    ap.add_argument("--index", default="precise", help="comma list of precise (KV events on) and learned (off)")
    ap.add_argument("--load-view", choices=LOAD_VIEWS, default=None,
                    help="own | engines (routing.shared_backends); default: engines with precise, own with learned")
    ap.add_argument("--kv-event-delay-ms", type=float, default=50.0, help="the replay's event delivery delay")
    ap.add_argument("--max-model-len", type=int, default=131072)
    ap.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    ap.add_argument("--proxy-offload-chars", type=int, default=None,
                    help="diagnostic: the proxy tokenizer's offload threshold in chars (default: the proxy's own); "
                         "a huge value tokenises every prompt inline, as the replay does")
    ap.add_argument("--proxy-drain-interval-ms", type=int, default=None,
                    help="telemetry.kv_events.drain_interval_ms of the replicas (default: the proxy's own; 0: "
                         "each KV-event message applied as it arrives)")
    ap.add_argument("--out", type=Path, help="write runs, summaries and the table (JSON) here")
    ap.add_argument("--records", type=Path, help="also write every request's live and replay record (JSON) here, "
                    "and print the slowest live first tokens beside their replay (where the tail comes from)")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(argv if argv is not None else sys.argv[1:])
    args = build_parser().parse_args(argv)
    if args.speed <= 0:
        raise SystemExit("--speed must be positive")
    if args.policy != "affinity" and any(x.strip() == "precise" for x in args.index.split(",")):
        raise SystemExit(f"--policy {args.policy} reads no KV index: use --index learned")
    if args.replicas < 1 or args.backends < 1 or args.workers < 1:
        raise SystemExit("--replicas, --workers and --backends must be >= 1")
    import uvloop

    uvloop.run(main_async(args, argv))


if __name__ == "__main__":
    main()
