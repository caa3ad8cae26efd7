"""How light is the simulator? One core drives N simulated servers under a steady streaming load.

    python -m loadtest.bench_sim --servers 8 --rate 50 --duration 20

starts `python -m sim --servers N` in a child process pinned to one core (CPU 0), sends `rate`
streaming completions per second in total (round robin over the servers, open loop: arrivals do not wait
for answers) from this process pinned to another core, and reports the child's CPU time (user + system,
from /proc) per request and per streamed token, next to the achieved rate and the client-side latencies.
If the simulator cannot keep up, the client sees it as growing TTFT and inter-token gaps, so those are
reported too: a light simulator shows TTFT close to the engine model's own (tens of ms here).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import uvloop

ROOT = Path(__file__).resolve().parents[1]


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks  # utime + stime


def _pin(cpu: int) -> None:
    if hasattr(os, "sched_setaffinity") and cpu < (os.cpu_count() or 1):
        os.sched_setaffinity(0, {cpu})


async def _one(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int, out: dict[str, list[float]]) -> None:
    t0 = time.perf_counter()
    first: float | None = None
    last = t0
    gaps: list[float] = []
    tokens = 0
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                out["errors"].append(1.0)
                return
            async for raw in resp.content:
                if not raw.startswith(b"data: "):
                    continue
                if raw.startswith(b"data: [DONE]"):
                    break
                now = time.perf_counter()
                if first is None:
                    first = now
                else:
                    gaps.append(now - last)
                last = now
                tokens += 1
    except aiohttp.ClientError:
        out["errors"].append(1.0)
        return
    if first is not None:
        out["ttft"].append(first - t0)
    out["gap"].extend(gaps)
    out["tokens"].append(float(tokens))


async def _load(urls: list[str], rate: float, duration: float, prompt_tokens: int, max_tokens: int,
                shared_prefix: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"ttft": [], "gap": [], "tokens": [], "errors": []}
    prefix = " ".join(f"sys{i}" for i in range(shared_prefix))
    n = int(rate * duration)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as session:
        tasks = []
        start = time.perf_counter()
        for i in range(n):
            due = start + i / rate
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            words = " ".join(f"u{i}w{j}" for j in range(prompt_tokens - shared_prefix))
            prompt = f"{prefix} {words}" if prefix else words
            tasks.append(asyncio.create_task(_one(session, urls[i % len(urls)], prompt, max_tokens, out)))
        await asyncio.gather(*tasks)
    return out


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run(servers: int, rate: float, duration: float, prompt_tokens: int, max_tokens: int, shared_prefix: int,
        profile: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen(
        [sys.executable, "-m", "sim", "--port", "0", "--servers", str(servers), "--profile", profile],
        stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT, preexec_fn=lambda: _pin(0),
    )
    try:
        assert child.stdout is not None
        urls = [child.stdout.readline().split()[1] for _ in range(servers)]
        _pin(1)
        cpu0 = _cpu_seconds(child.pid)
        wall0 = time.perf_counter()
        out = uvloop.run(_load(urls, rate, duration, prompt_tokens, max_tokens, shared_prefix))
        wall = time.perf_counter() - wall0
        cpu = _cpu_seconds(child.pid) - cpu0
    finally:
        child.terminate()
        child.wait(timeout=10)
    requests = len(out["tokens"])
    tokens = sum(out["tokens"])
    return {
        "servers": servers,
        "target_rate": rate,
        "requests_ok": requests,
        "errors": len(out["errors"]),
        "wall_s": wall,
        "completed_per_s": requests / wall,  # wall includes the tail after the last arrival
        "streamed_tokens": tokens,
        "sim_cpu_s": cpu,
        "sim_cpu_share_of_one_core": cpu / wall,
        "cpu_us_per_request": 1e6 * cpu / max(1, requests),
        "cpu_us_per_token": 1e6 * cpu / max(1.0, tokens),
        "ttft_p50_ms": 1e3 * _pct(out["ttft"], 0.5),
        "ttft_p99_ms": 1e3 * _pct(out["ttft"], 0.99),
        "itl_p50_ms": 1e3 * _pct(out["gap"], 0.5),
        "itl_p99_ms": 1e3 * _pct(out["gap"], 0.99),
        "itl_mean_ms": 1e3 * statistics.fmean(out["gap"]) if out["gap"] else float("nan"),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_sim", description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", type=int, default=8)
    p.add_argument("--rate", type=float, default=50.0, help="requests per second, all servers together")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--shared-prefix", type=int, default=256, help="tokens of a prefix every prompt shares")
    p.add_argument("--profile", default="llama3-8b-h100")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    res = run(args.servers, args.rate, args.duration, args.prompt_tokens, args.max_tokens, args.shared_prefix, args.profile)
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        for k, v in res.items():
            print(f"{k:28} {v:,.2f}" if isinstance(v, float) else f"{k:28} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
