"""Load generator: replays a workload against an OpenAI-compatible endpoint and records what each request saw.

    python -m loadtest.run --url http://127.0.0.1:8080 --workload mooncake --window 0:300 --speed 3 \\
        --metrics http://127.0.0.1:8001/metrics,http://127.0.0.1:8002/metrics --out run.json

Open loop (default): requests leave at their trace times divided by `--speed`, whatever the server does, so
a slow router cannot slow the offered load down and hide its own queueing (closed loops do; use
`--closed N` for N users sending back to back, e.g. for peak throughput). Without trace times (`--poisson
RATE`) arrivals are a seeded Poisson process.

Per request: send time, TTFT, time per output token, end-to-end latency, HTTP status, error, output tokens
(from the usage chunk), cached prompt tokens when the engine reports them, and the backend from the proxy's
`x-affinity-backend` debug header. With `--metrics`, every backend's /metrics is sampled once a second.

One core drives it: one aiohttp session, prompts rendered just before sending, SSE read line by line with
one small JSON parse per event.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Sequence

import aiohttp

from loadtest.fleet_sampler import FleetSampler
from loadtest.records import Record, RunConfig, RunResult
from loadtest.workloads import BlockText, Workload, WorkItem, build_body, load_workload, parse_window

BACKEND_HEADER = "x-affinity-backend"
# The simulator names itself in every response; peers that forward upstream headers keep it, so runs
# through sglang-router / vllm-router still know which backend served each request.
SIM_BACKEND_HEADER = "x-sim-backend"


def process_cpu_seconds(pids: Sequence[int]) -> float | None:
    """utime+stime of the processes, of every live descendant (a `run --workers N` supervisor's workers,
    which a parent's cutime counts only once they are reaped) and of their reaped children, from /proc
    (Linux); None if one of `pids` is unreadable. A descendant that exits between two reads moves its time
    into its parent's cutime, so a difference of two reads still counts it once. Descendants are found as
    `bench_workers` and `bench_proxy` find them, through /proc/PID/task/TID/children."""
    tick = os.sysconf("SC_CLK_TCK")
    roots = set(pids)
    seen: set[int] = set()
    todo = list(pids)
    total = 0.0
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            # fields[11..14] = utime, stime, cutime, cstime (stat fields 14-17)
            total += sum(int(x) for x in fields[11:15]) / tick
            for task in Path(f"/proc/{pid}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, IndexError, ValueError):
            if pid in roots:
                return None
            # a descendant gone meanwhile: its time is in its parent's cutime by the next read
    return total


class _Progress:
    """A one-line progress bar on stderr (a line every 5 s when stderr is not a terminal)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total = total
        self.enabled = enabled
        self.sent = self.done = self.errors = 0
        self.tty = sys.stderr.isatty()
        self._last = 0.0
        self.start = time.monotonic()

    def tick(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < (0.5 if self.tty else 5.0):
            return
        self._last = now
        width = 30
        filled = int(width * self.done / self.total) if self.total else width
        line = (
            f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} done, "
            f"{self.sent - self.done} in flight, {self.errors} errors, {now - self.start:6.1f}s"
        )
        sys.stderr.write(("\r" + line) if self.tty else (line + "\n"))
        if force and self.tty:
            sys.stderr.write("\n")
        sys.stderr.flush()


async def _one(
    session: aiohttp.ClientSession, cfg: RunConfig, item: WorkItem, index: int, text: BlockText,
    t0: float, scheduled: float,
) -> Record:
    path, body = build_body(item, text, model=cfg.model, extra=cfg.extra_body or None)
    headers = {"content-type": "application/json"}
    if cfg.api_key:
        headers["authorization"] = f"Bearer {cfg.api_key}"
    if cfg.session_header and item.session:
        headers[cfg.session_header] = item.session
    data = json.dumps(body).encode()
    loop = asyncio.get_running_loop()
    sent = loop.time()
    rec = Record(index=index, sent=sent - t0, scheduled=scheduled, input_tokens=item.input_tokens)
    first: float | None = None
    chunks = 0
    try:
        async with session.post(cfg.url.rstrip("/") + path, data=data, headers=headers) as resp:
            rec.status = resp.status
            rec.backend = resp.headers.get(BACKEND_HEADER) or resp.headers.get(SIM_BACKEND_HEADER)
            rec.request_id = resp.headers.get("x-request-id")
            if resp.status != 200:
                rec.error = (await resp.text())[:300]
                rec.e2e = loop.time() - sent
                return rec
            async for raw in resp.content:
                if not raw.startswith(b"data:"):
                    continue
                payload = raw[5:].strip()
                if payload == b"[DONE]":
                    break
                event = json.loads(payload)
                if "error" in event:
                    rec.error = str(event["error"])[:300]
                    continue
                choices = event.get("choices") or ()
                if choices:
                    c = choices[0]
                    piece = c.get("text")
                    if piece is None:
                        piece = (c.get("delta") or {}).get("content")
                    if piece:
                        chunks += 1
                        if first is None:
                            first = loop.time()
                usage = event.get("usage")
                if usage:
                    rec.output_tokens = int(usage.get("completion_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        rec.cached_tokens = int(details["cached_tokens"])
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:300]
    end = loop.time()
    rec.e2e = end - sent
    if first is not None:
        rec.ttft = first - sent
    if not rec.output_tokens:
        rec.output_tokens = chunks
    if first is not None and rec.output_tokens > 1:
        rec.tpot = (end - first) / (rec.output_tokens - 1)
    if rec.error is None and rec.status == 200 and first is None:
        rec.error = "stream ended without tokens"
    return rec


async def run_workload(
    workload: Workload,
    cfg: RunConfig,
    *,
    metrics_urls: dict[str, str] | None = None,
    proxy_pids: Sequence[int] = (),
) -> RunResult:
    """Drive `workload` at `cfg.url`; returns every request's record and the fleet samples."""
    text = workload.text()
    items = workload.items
    records: list[Record] = []
    progress = _Progress(len(items), cfg.progress)
    sampler = FleetSampler(metrics_urls) if metrics_urls else None
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None, enable_cleanup_closed=True)
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s, sock_connect=10.0)
    cpu0 = process_cpu_seconds(proxy_pids) if proxy_pids else None
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False) as session:
        if sampler:
            await sampler.start()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        wall0 = time.monotonic()
        gate = asyncio.Semaphore(cfg.max_inflight)

        async def fire(i: int, item: WorkItem, scheduled: float) -> None:
            async with gate:
                progress.sent += 1
                rec = await _one(session, cfg, item, i, text, t0, scheduled)
            records.append(rec)
            progress.done += 1
            if rec.error is not None:
                progress.errors += 1
            progress.tick()

        if cfg.closed:
            queue: asyncio.Queue[int] = asyncio.Queue()
            for i in range(len(items)):
                queue.put_nowait(i)

            async def user() -> None:
                while True:
                    try:
                        i = queue.get_nowait()
                    except asyncio.QueueEmpty:
                        return
                    await fire(i, items[i], loop.time() - t0)

            await asyncio.gather(*(user() for _ in range(cfg.closed)))
        else:
            tasks = []
            for i, item in enumerate(items):
                due = t0 + item.t / cfg.speed
                delay = due - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(fire(i, item, item.t / cfg.speed)))
                progress.tick()
            await asyncio.gather(*tasks)
        wall = loop.time() - t0
        if sampler:
            await sampler.stop()
    progress.tick(force=True)
    cpu1 = process_cpu_seconds(proxy_pids) if proxy_pids else None
    records.sort(key=lambda r: r.index)
    samples = []
    if sampler:
        samples = [{**s, "t": s["t"] - wall0} for s in sampler.samples]
    meta = {
        "label": cfg.label,
        "url": cfg.url,
        "mode": f"closed:{cfg.closed}" if cfg.closed else "open",
        "speed": cfg.speed,
        "model": cfg.model,
        "workload": workload.summary(),
        "workload_meta": workload.meta,
        "started_unix": time.time() - wall,
    }
    cpu = (cpu1 - cpu0) if cpu0 is not None and cpu1 is not None else None
    return RunResult(meta, records, samples, sampler.capacity_tokens if sampler else {}, wall, cpu)


def poisson_retime(workload: Workload, rate: float, seed: int) -> Workload:
    """Replace arrival times by a seeded Poisson process at `rate` per trace second."""
    rng = random.Random(seed)
    t = 0.0
    items = []
    for it in workload.items:
        items.append(WorkItem(t, it.input_tokens, it.output_tokens, it.segments, it.messages, it.model, it.session))
        t += rng.expovariate(rate)
    return Workload(workload.name + f"+poisson{rate}", items, workload.block_tokens, workload.namespace, workload.source, workload.meta)


def prepare_workload(args: argparse.Namespace) -> Workload:
    """Workload from the shared CLI options (--workload --window --limit --poisson --seed)."""
    w = load_workload(args.workload, seed=args.seed, prefer_sample=getattr(args, "sample", False))
    start, end = parse_window(args.window)
    if start is not None or end is not None or args.limit:
        w = w.window(start, end, args.limit)
    if getattr(args, "poisson", None):
        w = poisson_retime(w, args.poisson, args.seed or 0)
    return w


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--workload", default="mooncake", help="trace path, mooncake|azure-code|azure-conv, or mix|chat|sysprompt|lora[:k=v,...]")
    ap.add_argument("--window", help="trace slice START:END in trace seconds (applied before --speed)")
    ap.add_argument("--limit", type=int, help="at most this many requests (after --window)")
    ap.add_argument("--poisson", type=float, help="ignore trace times; Poisson arrivals at this rate (req/s of trace time)")
    ap.add_argument("--seed", type=int, default=0, help="seed of synthetic generators and Poisson arrivals")
    ap.add_argument("--sample", action="store_true", help="use the shipped sample even when ../shared/traces has the real trace")


def _metrics_arg(s: str | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for i, part in enumerate(filter(None, (p.strip() for p in (s or "").split(",")))):
        name, eq, url = part.partition("=")
        out[name if eq else f"backend-{i}"] = url if eq else name
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m loadtest.run", description="OpenAI streaming load generator")
    ap.add_argument("--url", required=True, help="base URL of the proxy or server, e.g. http://127.0.0.1:8080")
    add_workload_args(ap)
    ap.add_argument("--speed", type=float, default=1.0, help="time compression: 2 sends a 10-minute trace in 5 minutes")
    ap.add_argument("--closed", type=int, help="closed loop with N concurrent users (ignores arrival times)")
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--session-header", help="send each request's session/user id in this header (e.g. x-session-id)")
    ap.add_argument("--metrics", help="comma-separated [name=]URL of backend /metrics endpoints to sample each second")
    ap.add_argument("--proxy-pid", type=int, action="append", default=[], help="pid(s) whose CPU time to report")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--label", default="")
    ap.add_argument("--out", type=Path, help="write the run (JSON) here")
    ap.add_argument("--report", type=Path, help="also write report.md/.json/.png into this folder")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.speed <= 0:
        ap.error("--speed must be positive")
    workload = prepare_workload(args)
    if not workload.items:
        ap.error("the workload is empty (check --window/--limit)")
    cfg = RunConfig(
        url=args.url, model=args.model, speed=args.speed, closed=args.closed, session_header=args.session_header,
        timeout_s=args.timeout, progress=not args.no_progress, label=args.label or args.url,
    )
    import uvloop

    result = uvloop.run(run_workload(workload, cfg, metrics_urls=_metrics_arg(args.metrics), proxy_pids=args.proxy_pid))
    if args.out:
        result.save(args.out)
    from loadtest.report import summarize, write_report

    summary = summarize(result, workload)
    print(json.dumps({k: v for k, v in summary.items() if not isinstance(v, (list, dict))}, indent=1))
    if args.report:
        write_report([summary], args.report, title=f"loadtest.run {' '.join(sys.argv[1:])}", workload=workload)


if __name__ == "__main__":
    main()
