"""Load held: the highest steady rate ONE proxy worker serves with zero errors and a flat p99 (issue 18).

    python -m loadtest.steady --mode unary|stream --duration 600 [--rate R] [--out loadtest/results/steady]

What runs:
  - `affinity-proxy run --workers 1` (one process: the supervisor is not used with one worker), pinned with
    taskset to --proxy-core, access log on (to a file), telemetry scrapes and health checks off.
  - Two fake OpenAI backends answering from canned bytes (loadtest/bench_proxy.py `backend`: a raw asyncio
    protocol, no simulator), so that what saturates is the proxy, not what stands behind it. Streams are
    --events SSE chunks, one every --event-interval-ms.
  - An open-loop load generator in this process (uvloop, raw keep-alive connections, canned request
    bytes), pinned with the backends to --load-core: requests are due at a fixed rate whatever the answers
    do, and each latency is measured from the moment the request was DUE (a request waiting for a free
    connection counts its wait), so a proxy that falls behind shows as latency, not as a lower rate
    (no coordinated omission). Its own CPU share is printed and recorded: it must stay well below 100 %.

Procedure: a quick ramp (steps of --step-s seconds, rate x --factor each step, then two bisection steps)
finds the knee, the highest rate whose step had zero errors and a p99 within --p99-factor of the lowest step
p99 so far (or 25 ms above it, whichever is more); then --hold (0.9) of the knee is held for --duration
seconds, with a progress line every 10 s. `--rate R` skips the ramp and holds R.

"Held" means: zero errors, and every minute's p99 within 2x the median minute's p99 (flat). The result
(per-minute table: sent, ok, errors, p50, p99; ramp steps; machine load average; CPU of proxy and load
generator; the commit) is merged into OUT.json under the mode and OUT.md / OUT.png are rewritten from it.

Latency for streams: p50/p99 of the whole stream (request sent to the terminal chunk) and of the first
event (TTFB), both from the due time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import uvloop

from loadtest.bench_proxy import REQUEST_BODY, STREAM_BODY, cpu_seconds, free_port, pinned, stop_procs, wait_port

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 30.0  # a request not answered within this (from its due time) is an error
MAX_CONNECTIONS = 2048


# ---------------------------------------------------------------------------------------------- client


@dataclass
class Done:
    due: float  # time.monotonic() when the request was due
    latency: float  # due -> last byte, seconds
    ttfb: float  # due -> first body byte (streams) / = latency (unary)
    ok: bool
    why: str = ""


class _Conn(asyncio.Protocol):
    """One keep-alive connection: one request at a time, a minimal HTTP/1.1 response reader."""

    def __init__(self, gen: "OpenLoop") -> None:
        self.gen = gen
        self.transport: asyncio.Transport | None = None
        self.due: float | None = None
        self.buf = b""
        self.head_done = False
        self.status = 0
        self.length: int | None = None  # Content-Length, or None for chunked
        self.first: float | None = None
        self.close_after = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a TCP connection hands a Transport
        self.gen.connecting -= 1
        self.gen.conns.add(self)
        self.gen.idle_conn(self)

    def send(self, due: float) -> None:
        assert self.transport is not None
        self.due = due
        self.buf = b""
        self.head_done = False
        self.first = None
        self.transport.write(self.gen.request)

    def data_received(self, data: bytes) -> None:
        if self.due is None:
            return
        now = time.monotonic()
        if not self.head_done:
            self.buf += data
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].lower()
            self.status = int(head[9:12]) if head[:5] == b"http/" and head[9:12].isdigit() else 0
            m = re.search(rb"\r\ncontent-length:\s*(\d+)", head)
            self.length = int(m.group(1)) if m else None
            self.close_after = b"\r\nconnection: close" in head
            self.head_done = True
            data = self.buf[end + 4:]
            self.buf = b""
        if data and self.first is None:
            self.first = now
        if self.length is not None:
            self.length -= len(data)
            finished = self.length <= 0
        else:
            self.buf = (self.buf + data)[-16:]  # only the tail matters: the terminal chunk
            finished = self.buf.endswith(b"\r\n0\r\n\r\n") or self.buf == b"0\r\n\r\n"
        if finished:
            due, self.due = self.due, None
            ok = self.status == 200
            self.gen.finish(Done(due, now - due, (self.first or now) - due, ok, "" if ok else f"HTTP {self.status}"))
            if self.close_after and self.transport is not None:
                self.transport.close()
            else:
                self.gen.idle_conn(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.gen.conns.discard(self)
        try:
            self.gen.idle.remove(self)
        except ValueError:
            pass
        if self.due is not None:
            due, self.due = self.due, None
            now = time.monotonic()
            self.gen.finish(Done(due, now - due, now - due, False, f"connection lost ({exc or 'closed'})"))
        self.gen.top_up()


class OpenLoop:
    """Requests due at a fixed rate; a pool of keep-alive connections grown on demand up to MAX_CONNECTIONS."""

    def __init__(self, host: str, port: int, path: str, body: str) -> None:
        self.loop = asyncio.get_running_loop()
        self.host, self.port = host, port
        self.request = (
            f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body.encode())}\r\n\r\n"
        ).encode() + body.encode()
        self.conns: set[_Conn] = set()
        self.idle: deque[_Conn] = deque()
        self.waiting: deque[float] = deque()  # due times of requests with no free connection yet
        self.connecting = 0
        self.done: list[Done] = []
        self.outstanding = 0
        self.sent = 0

    def idle_conn(self, conn: _Conn) -> None:
        if self.waiting:
            conn.send(self.waiting.popleft())
        else:
            self.idle.append(conn)

    def dispatch(self, due: float) -> None:
        self.sent += 1
        self.outstanding += 1
        if self.idle:
            self.idle.popleft().send(due)
            return
        self.waiting.append(due)
        self.top_up()

    def top_up(self) -> None:
        while self.waiting and len(self.conns) + self.connecting < MAX_CONNECTIONS and (
            self.connecting < len(self.waiting)
        ):
            self.connecting += 1
            task = self.loop.create_task(self._connect())
            task.add_done_callback(lambda _t: None)

    async def _connect(self) -> None:
        try:
            await self.loop.create_connection(lambda: _Conn(self), self.host, self.port)
        except OSError as exc:
            self.connecting -= 1
            if self.waiting:
                due = self.waiting.popleft()
                now = time.monotonic()
                self.finish(Done(due, now - due, now - due, False, f"connect: {exc}"))

    def finish(self, d: Done) -> None:
        self.outstanding -= 1
        self.done.append(d)

    def expire(self) -> None:
        """Fail what has waited longer than TIMEOUT_S (queued, or in flight: that connection is closed)."""
        now = time.monotonic()
        while self.waiting and now - self.waiting[0] > TIMEOUT_S:
            due = self.waiting.popleft()
            self.finish(Done(due, now - due, now - due, False, "timeout (no connection)"))
        for conn in list(self.conns):
            if conn.due is not None and now - conn.due > TIMEOUT_S and conn.transport is not None:
                due, conn.due = conn.due, None
                self.finish(Done(due, now - due, now - due, False, "timeout"))
                conn.transport.close()

    async def run(self, rate: float, duration: float, on_tick: Any = None) -> float:
        """Dispatch `rate` requests/s for `duration` s (open loop); call on_tick(elapsed) every 10 s.

        Returns the start: request i is due at start + i / rate."""
        start = time.monotonic()
        end = start + duration
        i = 0
        next_tick = start + 10
        next_expire = start + 1
        while True:
            now = time.monotonic()
            due = start + i / rate
            while due <= now and due < end:
                self.dispatch(due)
                i += 1
                due = start + i / rate
            if now >= next_expire:
                self.expire()
                next_expire += 1
            if on_tick is not None and now >= next_tick:
                on_tick(next_tick - start)
                next_tick += 10
            if due >= end:
                return start
            await asyncio.sleep(max(0.0, min(due, next_tick, next_expire) - time.monotonic()))

    async def drain(self) -> None:
        limit = time.monotonic() + TIMEOUT_S + 2
        while self.outstanding > 0 and time.monotonic() < limit:
            self.expire()
            await asyncio.sleep(0.05)

    def close(self) -> None:
        for conn in list(self.conns):
            if conn.transport is not None:
                conn.transport.close()


# ---------------------------------------------------------------------------------------------- figures


def pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def summarise(done: Sequence[Done], seconds: float) -> dict[str, Any]:
    ok = [d for d in done if d.ok]
    errors: dict[str, int] = {}
    for d in done:
        if not d.ok:
            errors[d.why] = errors.get(d.why, 0) + 1
    lat = [d.latency * 1000 for d in ok]
    ttfb = [d.ttfb * 1000 for d in ok]
    return {
        "sent": len(done), "ok": len(ok), "errors": len(done) - len(ok), "why": errors,
        "rate": round(len(done) / seconds, 1) if seconds else 0.0,
        "p50_ms": round(pct(lat, 0.5), 2), "p99_ms": round(pct(lat, 0.99), 2),
        "ttfb_p50_ms": round(pct(ttfb, 0.5), 2), "ttfb_p99_ms": round(pct(ttfb, 0.99), 2),
    }


def self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


@dataclass
class Step:
    rate: float
    seconds: float
    result: dict[str, Any]
    proxy_cpu: float  # share of one core
    client_cpu: float
    good: bool
    proxy_wait: float = 0.0  # share of the wall time the proxy was runnable and waiting for its core


@dataclass
class Run:
    mode: str
    commit: str
    started: str
    events: int
    event_interval_ms: float
    ramp: list[Step] = field(default_factory=list)
    knee: float | None = None
    rate: float = 0.0
    duration_s: float = 0.0
    minutes: list[dict[str, Any]] = field(default_factory=list)
    ten_s: list[dict[str, Any]] = field(default_factory=list)
    cpu: list[dict[str, float]] = field(default_factory=list)  # every 10 s: proxy and generator CPU, load average
    total: dict[str, Any] = field(default_factory=dict)
    proxy_cpu: float = 0.0
    client_cpu: float = 0.0
    proxy_wait: float = 0.0
    loadavg_before: list[float] = field(default_factory=list)
    loadavg_after: list[float] = field(default_factory=list)
    held: bool = False
    flat: bool = False
    proxy_core: str = "0"
    load_core: str = "1"
    ramp_rule: str = ""
    note: str = ""  # --note: what the operator saw, rendered under the mode's summary


def buckets(done: Sequence[Done], start: float, width: float, count: int) -> list[dict[str, Any]]:
    groups: list[list[Done]] = [[] for _ in range(count)]
    for d in done:
        k = int((d.due - start) // width)
        if 0 <= k < count:
            groups[k].append(d)
    rows = []
    for k, g in enumerate(groups):
        row = summarise(g, width)
        row["t_s"] = round((k + 1) * width)
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------- driver


def _pin(core: str, argv: list[str]) -> list[str]:
    return pinned(core, argv) if core else argv  # "": not pinned (tests, one-core machines)


class Rig:
    """The backends and the proxy, as processes, and the proxy's CPU counter."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.procs: list[subprocess.Popen[bytes]] = []
        self.tmp = Path(tempfile.mkdtemp(prefix="steady_"))
        self.last_wait = 0.0  # proxy_wait share over the last measure()

    def start(self) -> int:
        a = self.args
        b1, b2 = free_port(), free_port()
        backend = subprocess.Popen(
            _pin(a.load_core, [sys.executable, "-m", "loadtest.bench_proxy", "backend", "--ports", f"{b1},{b2}",
                                 "--events", str(a.events), "--event-interval-ms", str(a.event_interval_ms)]),
            cwd=ROOT, stdout=subprocess.DEVNULL,
        )
        self.procs.append(backend)
        wait_port(b1, backend)
        wait_port(b2, backend)
        pport, aport = free_port(), free_port()
        cfg = self.tmp / "proxy.yaml"
        cfg.write_text(
            f"listen: {{port: {pport}}}\nadmin: {{port: {aport}}}\n"
            "telemetry: {enabled: false}\nhealth_checks: {enabled: false}\n"
            f"logging: {{access_log: {{path: '{self.tmp / 'access.log'}'}}}}\n"
            f"backends:\n  - {{name: b1, url: 'http://127.0.0.1:{b1}'}}\n  - {{name: b2, url: 'http://127.0.0.1:{b2}'}}\n"
        )
        exe = shutil.which("affinity-proxy", path=str(Path(sys.executable).parent)) or shutil.which("affinity-proxy")
        argv = [exe] if exe else [sys.executable, "-m", "proxy"]
        self.log = open(self.tmp / "proxy.log", "wb")
        proxy = subprocess.Popen(
            _pin(a.proxy_core, [*argv, "run", "--config", str(cfg), "--workers", "1", "--log-level", "warning"]),
            cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
        )
        self.procs.append(proxy)
        wait_port(pport, proxy)
        self.proxy = proxy
        return pport

    def proxy_cpu(self) -> float:
        return cpu_seconds([self.proxy.pid])

    def proxy_wait(self) -> float:
        """Seconds the proxy's threads have spent runnable but waiting for a CPU (/proc schedstat): on a
        shared machine, the share of the wall time the proxy wanted a core and did not get one."""
        total = 0
        for task in Path(f"/proc/{self.proxy.pid}/task").iterdir():
            try:
                total += int((task / "schedstat").read_text().split()[1])
            except (OSError, IndexError, ValueError):
                pass
        return total / 1e9

    def stop(self) -> None:
        stop_procs(self.procs)
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


async def measure(gen: OpenLoop, rig: Rig, rate: float, seconds: float, on_tick: Any = None) -> tuple[list[Done], float, float, float]:
    """One window at `rate`: the requests it sent (all finished), proxy and client CPU share, start time."""
    first = len(gen.done)
    p0, c0, q0, w0 = rig.proxy_cpu(), self_cpu(), rig.proxy_wait(), time.monotonic()
    start = await gen.run(rate, seconds, on_tick)
    p1, c1, q1, w1 = rig.proxy_cpu(), self_cpu(), rig.proxy_wait(), time.monotonic()
    await gen.drain()
    rig.last_wait = (q1 - q0) / (w1 - w0)
    return gen.done[first:], (p1 - p0) / (w1 - w0), (c1 - c0) / (w1 - w0), start


async def ramp(gen: OpenLoop, rig: Rig, a: argparse.Namespace, run: Run) -> float:
    base_p99: float | None = None

    async def step(rate: float) -> bool:
        nonlocal base_p99
        done, pcpu, ccpu, _ = await measure(gen, rig, rate, a.step_s)
        res = summarise(done, a.step_s)
        # The base is the lowest p99 of the steps so far (this one included): one step that a burst of other
        # work on a shared machine slowed must not become the yardstick of the next ones.
        base_p99 = res["p99_ms"] if base_p99 is None else min(base_p99, res["p99_ms"])
        limit = max(base_p99 * a.p99_factor, base_p99 + a.p99_slack_ms)
        good = res["errors"] == 0 and res["ok"] > 0 and res["p99_ms"] <= limit
        run.ramp.append(Step(round(rate, 1), a.step_s, res, round(pcpu, 3), round(ccpu, 3), good,
                             round(rig.last_wait, 3)))
        print(f"ramp {rate:8.1f}/s: ok {res['ok']:6d} err {res['errors']:4d} p50 {res['p50_ms']:7.2f} ms "
              f"p99 {res['p99_ms']:8.2f} ms (limit {limit:.1f})  proxy cpu {pcpu:4.0%} (waited {rig.last_wait:4.0%}) "
              f"client cpu {ccpu:4.0%}"
              f"  {'ok' if good else 'PAST THE KNEE'}", flush=True)
        await asyncio.sleep(1)
        return good

    rate, good_rate, bad_rate = a.ramp_start, 0.0, None
    while rate <= a.ramp_max:
        if await step(rate):
            good_rate = rate
            rate *= a.factor
        else:
            bad_rate = rate
            break
    if bad_rate is not None and good_rate > 0:
        for _ in range(2):
            mid = (good_rate + bad_rate) / 2
            if await step(mid):
                good_rate = mid
            else:
                bad_rate = mid
    return good_rate


async def main_async(a: argparse.Namespace) -> Run:
    rig = Rig(a)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "proxy"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    run = Run(a.mode, commit + ("+dirty proxy/" if dirty else ""), time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              a.events if a.mode == "stream" else 0, a.event_interval_ms if a.mode == "stream" else 0.0)
    run.loadavg_before = [round(x, 2) for x in os.getloadavg()]
    run.proxy_core, run.load_core = a.proxy_core, a.load_core
    run.ramp_rule = (f"a step is good with zero errors and p99 <= max({a.p99_factor:g} x the lowest step p99 so far, "
                     f"that + {a.p99_slack_ms:g} ms)")
    try:
        port = rig.start()
        gen = OpenLoop("127.0.0.1", port, "/v1/chat/completions", STREAM_BODY if a.mode == "stream" else REQUEST_BODY)
        # Warm-up: connections, the proxy's upstream pool.
        await measure(gen, rig, min(a.ramp_start, 50.0), 2)
        if a.rate:
            rate = a.rate
        else:
            knee = await ramp(gen, rig, a, run)
            if knee <= 0:
                raise SystemExit("the first ramp step already failed: nothing to hold")
            run.knee = round(knee, 1)
            rate = knee * a.hold
        run.rate = round(rate, 1)
        run.duration_s = a.duration
        print(f"hold {rate:.1f}/s for {a.duration:g} s (mode {a.mode}; knee {run.knee})", flush=True)
        seen = [len(gen.done), 0.0, rig.proxy_cpu(), self_cpu(), time.monotonic(), rig.proxy_wait()]

        def tick(elapsed: float) -> None:
            new = gen.done[int(seen[0]):]
            seen[0] = len(gen.done)
            p, c, w, q = rig.proxy_cpu(), self_cpu(), time.monotonic(), rig.proxy_wait()
            s = summarise(new, elapsed - seen[1])
            pcpu, ccpu, wait = (p - seen[2]) / (w - seen[4]), (c - seen[3]) / (w - seen[4]), (q - seen[5]) / (w - seen[4])
            run.cpu.append({"t_s": round(elapsed), "proxy": round(pcpu, 3), "client": round(ccpu, 3),
                            "proxy_wait": round(wait, 3), "load1": round(os.getloadavg()[0], 2)})
            print(f"{elapsed:5.0f} s: finished {s['sent']:6d} ok {s['ok']:6d} err {s['errors']:4d} "
                  f"p50 {s['p50_ms']:7.2f} ms p99 {s['p99_ms']:8.2f} ms  in flight {gen.outstanding:5d} "
                  f"conns {len(gen.conns):4d}  proxy cpu {pcpu:4.0%} (waited {wait:4.0%}) client cpu {ccpu:4.0%}  "
                  f"load {os.getloadavg()[0]:.1f}",
                  flush=True)
            seen[1:] = [elapsed, p, c, w, q]

        done, pcpu, ccpu, start = await measure(gen, rig, rate, a.duration, tick)
        run.proxy_cpu, run.client_cpu, run.proxy_wait = round(pcpu, 3), round(ccpu, 3), round(rig.last_wait, 3)
        minutes = max(1, round(a.duration / 60))
        width = a.duration / minutes
        run.minutes = buckets(done, start, width, minutes)
        run.ten_s = buckets(done, start, 10.0, max(1, int(a.duration // 10)))
        run.total = summarise(done, a.duration)
        p99s = [m["p99_ms"] for m in run.minutes if m["ok"]]
        med = statistics.median(p99s) if p99s else float("nan")
        run.flat = bool(p99s) and max(p99s) <= 2 * med
        run.held = run.total["errors"] == 0 and run.flat
        gen.close()
    finally:
        rig.stop()
    run.loadavg_after = [round(x, 2) for x in os.getloadavg()]
    return run


# ---------------------------------------------------------------------------------------------- report


def write_report(run: Run, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    jpath = out.with_suffix(".json")
    data: dict[str, Any] = json.loads(jpath.read_text()) if jpath.exists() else {}
    data[run.mode] = asdict(run)
    jpath.write_text(json.dumps(data, indent=1) + "\n")
    out.with_suffix(".md").write_text(render_md(data))
    try:
        plot(data, out.with_suffix(".png"))
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)


def per_request_us(r: dict[str, Any]) -> float:
    """The proxy's CPU µs per request: the median over the ramp's good steps (where it kept up), else the hold's
    CPU over the requests it answered in time."""
    steps = [s["proxy_cpu"] / s["rate"] for s in r["ramp"] if s["good"] and s["rate"]]
    if steps:
        return statistics.median(steps) * 1e6
    ok_rate = r["total"]["ok"] / r["duration_s"] if r["duration_s"] else 0
    return r["proxy_cpu"] / ok_rate * 1e6 if ok_rate and r["proxy_cpu"] else 0.0


def per_request_source(r: dict[str, Any]) -> str:
    return "median of the ramp's good steps" if any(s["good"] for s in r["ramp"]) else "the hold"


def render_md(data: dict[str, Any]) -> str:
    lines = [
        "# Load held: one worker, 10 minutes, open loop (issue 18)",
        "",
        "Tool: `python -m loadtest.steady --mode unary|stream --duration 600` (loadtest/steady.py; its module doc",
        "says what runs where). One `affinity-proxy run --workers 1` pinned to one core, access log on (to a file);",
        "two fake OpenAI backends answering canned bytes (bench_proxy's, no simulator: the proxy is what is",
        "measured) and the open-loop generator (fixed arrival rate, latency from each request's due time) on",
        "the other. This machine has 2 cores shared with other engineers' work: the load average is in each table.",
        "",
    ]
    for mode in ("unary", "stream"):
        r = data.get(mode)
        if not r:
            continue
        t = r["total"]
        what = ("non-streaming chat completions" if mode == "unary" else
                f"streaming chat completions, {r['events']} SSE events each, one every {r['event_interval_ms']:g} ms")
        lines += [
            f"## {mode}: {what}",
            "",
            f"Commit {r['commit']}, started {r['started']}; proxy on core {r.get('proxy_core', '0')}, generator and "
            f"backends on core {r.get('load_core', '1')}. Knee from the ramp: **{r['knee']}/s**; held "
            f"**{r['rate']}/s for {r['duration_s']:g} s**: {t['sent']:,} sent, {t['ok']:,} ok, {t['errors']:,} errors"
            + (f" ({', '.join(f'{k}: {v}' for k, v in t['why'].items())})" if t["why"] else "")
            + f"; p50 {t['p50_ms']} ms, p99 {t['p99_ms']} ms"
            + (f"; first event p50 {t['ttfb_p50_ms']} ms, p99 {t['ttfb_p99_ms']} ms" if mode == "stream" else "")
            + f". Proxy CPU {r['proxy_cpu']:.0%} of its core (and {r.get('proxy_wait', 0):.0%} of the time runnable but "
            f"waiting for it: other processes had it), load generator {r['client_cpu']:.0%} of its core. "
            + (f"CPU per request ({per_request_source(r)}): {per_request_us(r):.0f} µs, so one dedicated core would "
               f"serve about {1e6 / per_request_us(r):.0f}/s at 100 % (an extrapolation, not a measurement). "
               if per_request_us(r) else "")
            +
            f"Load average before/after: {r['loadavg_before']} / {r['loadavg_after']}. "
            f"**{'Held' if r['held'] else 'NOT held'}** (zero errors: {'yes' if t['errors'] == 0 else 'no'}; "
            f"p99 flat, every minute within 2x the median minute: {'yes' if r['flat'] else 'no'})."
            + (f" **The proxy was runnable but waiting for its core {r['proxy_wait']:.0%} of the hold** (other "
               "processes on it): this run measures the machine's contention more than the proxy."
               if r.get("proxy_wait", 0) > 0.2 else ""),
            "",
            *([r["note"], ""] if r.get("note") else []),
            "| minute | sent | ok | errors | p50 ms | p99 ms |" + (" first event p99 ms |" if mode == "stream" else "")
            + " proxy CPU | proxy waiting for a CPU | load avg (1 min) |",
            "|---:|---:|---:|---:|---:|---:|" + ("---:|" if mode == "stream" else "") + "---:|---:|---:|",
        ]
        for i, m in enumerate(r["minutes"], 1):
            lo, hi = m["t_s"] - r["duration_s"] / len(r["minutes"]), m["t_s"]
            cpu = [c for c in r.get("cpu", []) if lo < c["t_s"] <= hi]
            share = f"{sum(c['proxy'] for c in cpu) / len(cpu):.0%}" if cpu else "-"
            load = f"{max(c['load1'] for c in cpu):.1f}" if cpu else "-"
            wait = f"{sum(c.get('proxy_wait', 0) for c in cpu) / len(cpu):.0%}" if cpu else "-"
            lines.append(f"| {i} | {m['sent']:,} | {m['ok']:,} | {m['errors']:,} | {m['p50_ms']} | {m['p99_ms']} |"
                         + (f" {m['ttfb_p99_ms']} |" if mode == "stream" else "") + f" {share} | {wait} | {load} |")
        if r["ramp"]:
            lines += ["", "Ramp (each step " + f"{r['ramp'][0]['seconds']:g} s; {r.get('ramp_rule') or 'rule: see the module doc'}):", "",
                      "| rate/s | ok | errors | p50 ms | p99 ms | proxy CPU | proxy waiting | generator CPU | verdict |",
                      "|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
            for s in r["ramp"]:
                res = s["result"]
                lines.append(f"| {s['rate']} | {res['ok']:,} | {res['errors']:,} | {res['p50_ms']} | {res['p99_ms']} | "
                             f"{s['proxy_cpu']:.0%} | {s.get('proxy_wait', 0):.0%} | {s['client_cpu']:.0%} | {'ok' if s['good'] else 'past the knee'} |")
        lines.append("")
    lines += ["Plot: steady.png (per 10 s: p50/p99 and requests finished per second). Raw: steady.json.", ""]
    return "\n".join(lines)


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in ("unary", "stream") if m in data]
    fig, axes = plt.subplots(2, len(modes), figsize=(6 * len(modes), 6), sharex="col", squeeze=False)
    for col, mode in enumerate(modes):
        r = data[mode]
        rows = r["ten_s"]
        t = [row["t_s"] / 60 for row in rows]
        ax = axes[0][col]
        ax.plot(t, [row["p50_ms"] for row in rows], marker=".", label="p50")
        ax.plot(t, [row["p99_ms"] for row in rows], marker=".", label="p99")
        ax.set_ylabel("latency ms (per 10 s)")
        ax.set_ylim(bottom=0)
        ax.legend()
        ax.set_title(f"{mode}: {r['rate']}/s held (knee {r['knee']}/s), {r['total']['errors']} errors")
        ax = axes[1][col]
        ax.plot(t, [row["ok"] / 10 for row in rows], marker=".", label="ok/s")
        ax.plot(t, [row["errors"] / 10 for row in rows], marker=".", color="red", label="errors/s")
        ax.set_ylabel("per second")
        ax.set_ylim(bottom=0)
        ax.set_xlabel("minutes")
        ax.legend()
    fig.suptitle("affinity-proxy, one worker, open-loop steady load")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.steady", description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("unary", "stream"), default="unary")
    p.add_argument("--duration", type=float, default=600, help="seconds to hold the rate (default 600)")
    p.add_argument("--rate", type=float, default=0, help="hold this rate, no ramp")
    p.add_argument("--hold", type=float, default=0.9, help="share of the knee held (default 0.9)")
    p.add_argument("--ramp-start", type=float, default=100, help="first ramp rate, requests/s")
    p.add_argument("--ramp-max", type=float, default=50_000)
    p.add_argument("--factor", type=float, default=1.3, help="rate growth per ramp step")
    p.add_argument("--step-s", type=float, default=8, help="seconds per ramp step")
    p.add_argument("--p99-factor", type=float, default=3.0, help="a step whose p99 exceeds this x the first's is past the knee")
    p.add_argument("--p99-slack-ms", type=float, default=25.0,
                   help="... or exceeds it by more than this (whichever is more); a busy shared machine needs more")
    p.add_argument("--events", type=int, default=20, help="stream mode: SSE events per response")
    p.add_argument("--event-interval-ms", type=float, default=10.0, help="stream mode: pace of the events")
    p.add_argument("--proxy-core", default="0", help="taskset core list for the proxy ('' : not pinned)")
    p.add_argument("--load-core", default="1", help="core list for the load generator and backends ('' : not pinned)")
    p.add_argument("--out", default=str(ROOT / "loadtest" / "results" / "steady"),
                   help="OUT.json/.md/.png (the mode's entry is replaced, the other kept)")
    p.add_argument("--render", action="store_true", help="only rewrite OUT.md / OUT.png from OUT.json")
    p.add_argument("--note", default=None, help="a remark kept with the run (with --render: set on --mode's run)")
    a = p.parse_args(argv)
    if a.render:
        data = json.loads(Path(a.out).with_suffix(".json").read_text())
        if a.note is not None:
            data[a.mode]["note"] = a.note
            Path(a.out).with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
        Path(a.out).with_suffix(".md").write_text(render_md(data))
        plot(data, Path(a.out).with_suffix(".png"))
        return 0
    if shutil.which("taskset") and a.load_core:
        os.sched_setaffinity(0, {int(c) for c in a.load_core.split(",")})
    run = uvloop.run(main_async(a))
    run.note = a.note or ""
    write_report(run, Path(a.out))
    t = run.total
    print(f"{run.mode}: held {run.rate}/s for {run.duration_s:g} s: {t['sent']} sent, {t['errors']} errors, "
          f"p99 {t['p99_ms']} ms -> {'HELD' if run.held else 'NOT HELD'}; wrote {a.out}.md/.json/.png", flush=True)
    return 0 if run.held else 1


if __name__ == "__main__":
    sys.exit(main())
