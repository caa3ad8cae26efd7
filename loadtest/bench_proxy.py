"""Proxy overhead, side by side in one run: direct to a backend, through nginx, through affinity-proxy.

    python -m loadtest.bench_proxy [--duration 5] [--policy round_robin] [--no-nginx]
    python -m loadtest.bench_proxy --observability [--rounds 3] [--baseline DIR]

What it measures (the same three figures as shared/peers/README.md, on the same kind of setup):
  - CPU µs per small request: wrk, 64 connections, non-streaming POST; proxy CPU time / requests.
  - CPU µs per SSE event: 32 concurrent streams of 200 events each (one event per stream every
    --event-interval-ms); proxy CPU time / events relayed.
  - Added p50/p99 latency at concurrency 1: wrk -c1 through the proxy minus wrk -c1 direct.

The backend is deliberately cheap (a raw asyncio protocol answering canned bytes), not the simulator, so
that the proxy's own cost dominates. Layout on the 2-core machine: the proxy (or nginx, one worker) pinned
to core 0, the fake backend and the load generators to core 1. CPU time is read from /proc for the proxy
process (and nginx's workers), over exactly the load window. Other processes on the machine add noise:
compare the columns of one run, not numbers across runs.

`--observability` compares affinity-proxy with itself instead: access log and tracing both off, tracing on
(OTLP/HTTP to a sink in the backend process) at ratio 0.1 and 1.0, and the access log on (to a file); with
`--baseline DIR` also the proxy as it was before observability was hooked in (a `git archive` of that
commit in DIR). The targets are measured in turns, `--rounds` times, and the medians reported as CPU per
request / per SSE event and as ratios to "both off", so that drift on a loaded machine hits all alike.

Subcommands `backend` and `sse-client` are the helper processes this script starts itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import uvloop

ROOT = Path(__file__).resolve().parents[1]
TICKS = os.sysconf("SC_CLK_TCK")
PROXY_CORE, LOAD_CORE = "0", "1"

REQUEST_BODY = json.dumps(
    {"model": "bench", "messages": [{"role": "user", "content": "Say hello in one short sentence."}], "max_tokens": 16}
)
STREAM_BODY = json.dumps(
    {"model": "bench", "stream": True, "messages": [{"role": "user", "content": "Count to two hundred."}]}
)
JSON_ANSWER = json.dumps(
    {"id": "cmpl-bench", "object": "chat.completion", "created": 0, "model": "bench",
     "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello there, nice to meet you!"},
                  "finish_reason": "stop"}],
     "usage": {"prompt_tokens": 9, "completion_tokens": 8, "total_tokens": 17}}
).encode()


# ---------------------------------------------------------------------------------------------- backend


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class _FakeBackend(asyncio.Protocol):
    """HTTP/1.1 keep-alive server answering every request from canned bytes; streams are paced by a ticker."""

    json_response = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
        % (len(JSON_ANSWER), JSON_ANSWER)
    )
    stream_head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    event = _chunk(
        b'data: {"id":"cmpl-bench","object":"chat.completion.chunk","created":0,"model":"bench",'
        b'"choices":[{"index":0,"delta":{"content":"tok "},"finish_reason":null}]}\n\n'
    )
    done = _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"

    def __init__(self, streams: dict[_FakeBackend, int], events: int) -> None:
        self.buf = b""
        self.streams = streams
        self.events = events
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.streams.pop(self, None)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].lower()
            m = re.search(rb"content-length:\s*(\d+)", head)
            length = int(m.group(1)) if m else 0
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4 : end + 4 + length]
            self.buf = self.buf[end + 4 + length :]
            assert self.transport is not None
            if b'"stream": true' in body or b'"stream":true' in body:
                self.transport.write(self.stream_head)
                self.streams[self] = self.events
            else:
                self.transport.write(self.json_response)

    def tick(self) -> bool:
        """Send one event; True when the stream is finished."""
        assert self.transport is not None
        left = self.streams[self] - 1
        if left <= 0:
            self.transport.write(self.event + self.done)
            return True
        self.streams[self] = left
        self.transport.write(self.event)
        return False


async def _otlp_sink(port: int) -> None:
    """An OTLP/HTTP collector that accepts every export and keeps nothing (the tracing variants' endpoint)."""
    from aiohttp import web

    async def accept(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", accept)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()


async def run_backend(ports: Sequence[int], events: int, interval_ms: float, otlp_port: int | None = None) -> None:
    loop = asyncio.get_running_loop()
    if otlp_port is not None:
        await _otlp_sink(otlp_port)
    streams: dict[_FakeBackend, int] = {}
    servers = [
        await loop.create_server(lambda: _FakeBackend(streams, events), "127.0.0.1", p, backlog=4096, reuse_address=True)
        for p in ports
    ]
    interval = interval_ms / 1000

    async def ticker() -> None:
        while True:
            await asyncio.sleep(interval)
            for proto in [p for p in streams if p.tick()]:
                streams.pop(proto, None)

    task = asyncio.create_task(ticker())
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    print("ready", flush=True)
    await stop.wait()
    task.cancel()
    for s in servers:
        s.close()


# ---------------------------------------------------------------------------------------------- SSE load


class _SseClient(asyncio.Protocol):
    """One keep-alive connection issuing streaming requests back to back, counting `data:` events."""

    def __init__(self, request: bytes, counters: list[int], deadline: float) -> None:
        self.request = request
        self.counters = counters
        self.deadline = deadline
        self.tail = b""
        self.done = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.write(self.request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        window = self.tail + data
        self.counters[0] += window.count(b"data: {") - self.tail.count(b"data: {")
        self.tail = window[-64:]
        if window.endswith(b"\r\n0\r\n\r\n") and b"[DONE]" in window[-96:]:
            self.counters[1] += 1
            self.tail = b""
            if time.monotonic() < self.deadline:
                assert self.transport is not None
                self.transport.write(self.request)
            else:
                self.transport.close()  # type: ignore[union-attr]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)


async def run_sse_client(host: str, port: int, path: str, concurrency: int, duration: float) -> None:
    loop = asyncio.get_running_loop()
    body = STREAM_BODY.encode()
    request = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    counters = [0, 0]
    deadline = time.monotonic() + duration
    protos = []
    for _ in range(concurrency):
        _, proto = await loop.create_connection(lambda: _SseClient(request, counters, deadline), host, port)
        protos.append(proto)
    await asyncio.wait_for(asyncio.gather(*(p.done for p in protos)), duration + 60)
    print(json.dumps({"events": counters[0], "streams": counters[1]}), flush=True)


# ---------------------------------------------------------------------------------------------- driver


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pids: Sequence[int]) -> float:
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / TICKS


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(p) for p in fh.read().split()]
    except OSError:
        return []


def stop_procs(procs: list[subprocess.Popen[Any]], timeout_s: float = 10) -> None:
    """SIGTERM each process still running, newest first (so a proxy goes before its backends), and kill
    the ones that have not exited within `timeout_s`."""
    for p in reversed(procs):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()


def wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}")


def pinned(core: str, argv: list[str]) -> list[str]:
    return ["taskset", "-c", core, *argv] if shutil.which("taskset") else argv


@dataclass
class Target:
    name: str
    port: int
    pids: list[int] = field(default_factory=list)  # processes whose CPU is the proxy's cost (empty: direct)
    results: dict[str, float] = field(default_factory=dict)


_UNITS = {"us": 1.0, "ms": 1000.0, "s": 1_000_000.0}


def _wrk(port: int, connections: int, duration: float, latency: bool, lua: str) -> tuple[float, dict[str, float]]:
    argv = ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(duration))}s", "-s", lua]
    if latency:
        argv.append("--latency")
    argv.append(f"http://127.0.0.1:{port}/v1/chat/completions")
    out = subprocess.run(pinned(LOAD_CORE, argv), capture_output=True, text=True, check=True).stdout
    m = re.search(r"^\s*(\d+) requests in", out, re.M)
    if m is None:
        raise RuntimeError(f"unexpected wrk output:\n{out}")
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if errors:
        raise RuntimeError(f"wrk saw {errors.group(1)} error responses:\n{out}")
    pct = {
        p: float(v) * _UNITS[u]
        for p, v, u in re.findall(r"^\s+(50|99)%\s+([\d.]+)(us|ms|s)\s*$", out, re.M)
    }
    return float(m.group(1)), pct


def _measure(target: Target, fn: object) -> tuple[object, float]:
    pids = target.pids
    before = cpu_seconds(pids) if pids else 0.0
    result = fn()  # type: ignore[operator]
    after = cpu_seconds(pids) if pids else 0.0
    return result, after - before


def bench_target(target: Target, duration: float, lua: str) -> None:
    # warm-up: connections, caches
    _wrk(target.port, 64, 1, False, lua)
    (requests, _), cpu = _measure(target, lambda: _wrk(target.port, 64, duration, False, lua))  # type: ignore[misc]
    target.results["rps_c64"] = requests / duration
    target.results["cpu_us_per_request"] = cpu / requests * 1e6 if target.pids else float("nan")

    def sse() -> dict[str, int]:
        argv = [sys.executable, "-m", "loadtest.bench_proxy", "sse-client", "--port", str(target.port),
                "--concurrency", "32", "--duration", str(duration)]
        out = subprocess.run(pinned(LOAD_CORE, argv), capture_output=True, text=True, check=True, cwd=ROOT).stdout
        return json.loads(out.strip().splitlines()[-1])

    counts, cpu = _measure(target, sse)
    events = counts["events"]  # type: ignore[index]
    target.results["sse_events_per_s"] = events / duration
    target.results["cpu_us_per_event"] = cpu / events * 1e6 if target.pids and events else float("nan")

    _, pct = _wrk(target.port, 1, duration, True, lua)
    target.results["p50_us"] = pct.get("50", float("nan"))
    target.results["p99_us"] = pct.get("99", float("nan"))


NGINX_CONF = """daemon off;
master_process on;
worker_processes 1;
pid nginx.pid;
error_log logs/error.log warn;
worker_rlimit_nofile 65536;
events {{ worker_connections 16384; multi_accept on; }}
http {{
    access_log off;
    client_body_temp_path client_body;
    proxy_temp_path proxy;
    fastcgi_temp_path fastcgi;
    uwsgi_temp_path uwsgi;
    scgi_temp_path scgi;
    keepalive_requests 1000000;
    keepalive_timeout 75s;
    upstream llm {{
        server 127.0.0.1:{b1};
        server 127.0.0.1:{b2};
        keepalive 128;
        keepalive_requests 1000000;
        keepalive_timeout 60s;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            proxy_pass http://llm;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_cache off;
            proxy_read_timeout 3600s;
            proxy_send_timeout 3600s;
        }}
    }}
}}
"""


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else float("nan")


def main_observability(args: argparse.Namespace) -> int:
    """affinity-proxy against itself: what the access log and tracing cost per request (module doc)."""
    if shutil.which("wrk") is None:
        print("wrk is required (Debian package `wrk`)", file=sys.stderr)
        return 2
    procs: list[subprocess.Popen[bytes]] = []
    tmp = Path(tempfile.mkdtemp(prefix="bench_obs_"))
    lua = tmp / "post.lua"
    lua.write_text('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
                   f"wrk.body = {json.dumps(REQUEST_BODY)}\n")
    try:
        b1, b2, otlp = free_port(), free_port(), free_port()
        backend = subprocess.Popen(
            pinned(LOAD_CORE, [sys.executable, "-m", "loadtest.bench_proxy", "backend", "--ports", f"{b1},{b2}",
                               "--events", str(args.events), "--event-interval-ms", str(args.event_interval_ms),
                               "--otlp-port", str(otlp)]),
            cwd=ROOT, stdout=subprocess.DEVNULL,
        )
        procs.append(backend)
        wait_port(b1, backend)
        wait_port(otlp, backend)
        sink = f"http://127.0.0.1:{otlp}/v1/traces"
        variants = [
            ("both off", "logging: {access_log: {enabled: false}}\n", None),
            # ratio 0: every request takes the unsampled path (the sampling decision, the W3C header to the
            # backend), none is exported: what tracing costs before any span is recorded.
            ("tracing 0.0", f"logging: {{access_log: {{enabled: false}}}}\ntracing: {{enabled: true, ratio: 0.0, endpoint: '{sink}'}}\n", None),
            ("tracing 0.1", f"logging: {{access_log: {{enabled: false}}}}\ntracing: {{enabled: true, ratio: 0.1, endpoint: '{sink}'}}\n", None),
            ("tracing 1.0", f"logging: {{access_log: {{enabled: false}}}}\ntracing: {{enabled: true, ratio: 1.0, endpoint: '{sink}'}}\n", None),
            ("access log", f"logging: {{access_log: {{enabled: true, path: '{tmp / 'access.log'}'}}}}\n", None),
        ]
        if args.baseline:
            variants.insert(0, ("before (baseline)", "", Path(args.baseline).resolve()))
        if args.only:
            keep = set(args.only.split(","))
            variants = [v for v in variants if v[0] in keep or v[0] == "both off"]
        targets: list[Target] = []
        for name, section, tree in variants:
            pport, aport = free_port(), free_port()
            cfg = tmp / f"proxy-{len(targets)}.yaml"
            cfg.write_text(
                f"listen: {{port: {pport}}}\nadmin: {{port: {aport}}}\nrouting: {{policy: {args.policy}}}\n"
                "telemetry: {enabled: false}\nhealth_checks: {enabled: false}\n" + section +
                f"backends:\n  - {{name: b1, url: 'http://127.0.0.1:{b1}'}}\n  - {{name: b2, url: 'http://127.0.0.1:{b2}'}}\n"
            )
            env = {**os.environ, "PYTHONPATH": str(tree)} if tree is not None else None
            proc = subprocess.Popen(
                pinned(PROXY_CORE, [sys.executable, "-m", "proxy", "run", "--config", str(cfg), "--workers", "1",
                                    "--log-level", "warning"]),
                cwd=tree or ROOT, env=env, stdout=subprocess.DEVNULL,
            )
            procs.append(proc)
            wait_port(pport, proc)
            targets.append(Target(name, pport, [proc.pid]))
        samples: dict[str, dict[str, list[float]]] = {t.name: {"req": [], "event": [], "rps": []} for t in targets}
        for t in targets:  # warm-up: connections, caches, the exporter's first batches
            _wrk(t.port, 64, 1, False, str(lua))
        for round_ in range(args.rounds):
            for t in targets:
                print(f"... round {round_ + 1}/{args.rounds}: {t.name}", file=sys.stderr, flush=True)
                (requests, _), cpu = _measure(t, lambda: _wrk(t.port, 64, args.duration, False, str(lua)))  # type: ignore[misc]
                samples[t.name]["req"].append(cpu / requests * 1e6)
                samples[t.name]["rps"].append(requests / args.duration)
                sse_argv = [sys.executable, "-m", "loadtest.bench_proxy", "sse-client", "--port", str(t.port),
                            "--concurrency", "32", "--duration", str(args.duration)]
                out, cpu = _measure(t, lambda: subprocess.run(
                    pinned(LOAD_CORE, sse_argv), capture_output=True, text=True, check=True, cwd=ROOT).stdout)
                events = json.loads(str(out).strip().splitlines()[-1])["events"]
                samples[t.name]["event"].append(cpu / events * 1e6 if events else float("nan"))
        base = "both off"
        base_req, base_ev = _median(samples[base]["req"]), _median(samples[base]["event"])
        print(f"\nbench_proxy --observability: {args.rounds} rounds x {args.duration:g} s, medians; wrk c64 "
              f"non-streaming POST, 32 SSE streams of {args.events} events; proxy on core {PROXY_CORE}")
        print(f"{'':20}{'CPU µs/request':>16}{'ratio':>8}{'Δ µs/req':>10}{'req/s c64':>11}"
              f"{'CPU µs/event':>14}{'ratio':>8}   per-round µs/request")
        for t in targets:
            req, ev = _median(samples[t.name]["req"]), _median(samples[t.name]["event"])
            rounds = " ".join(f"{v:.1f}" for v in samples[t.name]["req"])
            print(f"{t.name:20}{req:16.1f}{req / base_req:8.3f}{req - base_req:10.1f}"
                  f"{_median(samples[t.name]['rps']):11.0f}{ev:14.2f}{ev / base_ev:8.3f}   {rounds}")
        return 0
    finally:
        stop_procs(procs)
        shutil.rmtree(tmp, ignore_errors=True)


def main_bench(args: argparse.Namespace) -> int:
    if shutil.which("wrk") is None:
        print("wrk is required (Debian package `wrk`)", file=sys.stderr)
        return 2
    procs: list[subprocess.Popen[bytes]] = []
    tmp = Path(tempfile.mkdtemp(prefix="bench_proxy_"))
    lua = tmp / "post.lua"
    lua.write_text(
        'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
        f"wrk.body = {json.dumps(REQUEST_BODY)}\n"
    )
    try:
        b1, b2 = free_port(), free_port()
        backend = subprocess.Popen(
            pinned(LOAD_CORE, [sys.executable, "-m", "loadtest.bench_proxy", "backend", "--ports", f"{b1},{b2}",
                               "--events", str(args.events), "--event-interval-ms", str(args.event_interval_ms)]),
            cwd=ROOT, stdout=subprocess.DEVNULL,
        )
        procs.append(backend)
        wait_port(b1, backend)
        wait_port(b2, backend)
        targets = [Target("direct", b1)]

        if not args.no_nginx and shutil.which("nginx"):
            nport = free_port()
            (tmp / "logs").mkdir()
            (tmp / "nginx.conf").write_text(NGINX_CONF.format(b1=b1, b2=b2, port=nport))
            nginx = subprocess.Popen(pinned(PROXY_CORE, ["nginx", "-p", str(tmp), "-c", str(tmp / "nginx.conf")]),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            procs.append(nginx)
            wait_port(nport, nginx)
            targets.append(Target("nginx", nport, [nginx.pid, *children(nginx.pid)]))
        elif not args.no_nginx:
            print("nginx not found (apt-get install nginx): skipping it", file=sys.stderr)

        pport, aport = free_port(), free_port()
        cfg = tmp / "proxy.yaml"
        cfg.write_text(
            f"listen: {{port: {pport}}}\nadmin: {{port: {aport}}}\nrouting: {{policy: {args.policy}}}\n"
            # No scraping or health checks: the fake backend has no /metrics, and the figure is the data
            # plane's cost per request.
            "telemetry: {enabled: false}\nhealth_checks: {enabled: false}\n"
            f"backends:\n  - {{name: b1, url: 'http://127.0.0.1:{b1}'}}\n  - {{name: b2, url: 'http://127.0.0.1:{b2}'}}\n"
        )
        proxy = subprocess.Popen(
            pinned(PROXY_CORE, [sys.executable, "-m", "proxy", "run", "--config", str(cfg), "--workers", "1",
                                "--log-level", "warning"]),
            cwd=ROOT,
        )
        procs.append(proxy)
        wait_port(pport, proxy)
        targets.append(Target(f"affinity-proxy ({args.policy})", pport, [proxy.pid]))

        for t in targets:
            print(f"... {t.name}", file=sys.stderr, flush=True)
            bench_target(t, args.duration, str(lua))
        print_table(targets, args)
        return 0
    finally:
        stop_procs(procs)
        shutil.rmtree(tmp, ignore_errors=True)


def print_table(targets: list[Target], args: argparse.Namespace) -> None:
    direct = targets[0].results
    rows = [
        ("requests/s, c64 (non-streaming)", "rps_c64", "{:.0f}"),
        ("CPU µs per request (c64)", "cpu_us_per_request", "{:.1f}"),
        ("SSE events/s (32 streams)", "sse_events_per_s", "{:.0f}"),
        ("CPU µs per SSE event", "cpu_us_per_event", "{:.2f}"),
        ("p50 latency c1 (µs)", "p50_us", "{:.0f}"),
        ("p99 latency c1 (µs)", "p99_us", "{:.0f}"),
    ]
    names = [t.name for t in targets]
    width = max(len(n) for n in names) + 2
    print(f"\nbench_proxy: {args.duration:g} s per measurement, {args.events} events/stream every "
          f"{args.event_interval_ms:g} ms; proxies on core {PROXY_CORE}, backend + load on core {LOAD_CORE}")
    print(f"{'':34}" + "".join(f"{n:>{width}}" for n in names))
    for label, key, fmt in rows:
        cells = []
        for t in targets:
            v = t.results.get(key, float("nan"))
            cells.append("-" if v != v else fmt.format(v))
        print(f"{label:34}" + "".join(f"{c:>{width}}" for c in cells))
    for key, label in (("p50_us", "added p50 latency c1 (µs)"), ("p99_us", "added p99 latency c1 (µs)")):
        cells = ["-"] + [f"{t.results[key] - direct[key]:.0f}" for t in targets[1:]]
        print(f"{label:34}" + "".join(f"{c:>{width}}" for c in cells))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_proxy", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd")
    b = sub.add_parser("backend")
    b.add_argument("--ports", required=True)
    b.add_argument("--events", type=int, default=200)
    b.add_argument("--event-interval-ms", type=float, default=1.0)
    b.add_argument("--otlp-port", type=int, default=None, help="also accept OTLP/HTTP trace exports here")
    c = sub.add_parser("sse-client")
    c.add_argument("--host", default="127.0.0.1")
    c.add_argument("--port", type=int, required=True)
    c.add_argument("--path", default="/v1/chat/completions")
    c.add_argument("--concurrency", type=int, default=32)
    c.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--duration", type=int, default=5, help="seconds per measurement (default 5)")
    p.add_argument("--policy", default="round_robin", help="affinity-proxy routing policy (default round_robin)")
    p.add_argument("--events", type=int, default=200, help="SSE events per streamed response")
    p.add_argument("--event-interval-ms", type=float, default=1.0, help="pace of each stream's events")
    p.add_argument("--no-nginx", action="store_true")
    p.add_argument("--observability", action="store_true",
                   help="compare the proxy with access log / tracing off and on (see the module doc)")
    p.add_argument("--rounds", type=int, default=3, help="--observability: measurement rounds (medians)")
    p.add_argument("--only", default=None, metavar="NAMES",
                   help="--observability: comma-separated variant names to run (\"both off\" always runs)")
    p.add_argument("--baseline", default=None, metavar="DIR",
                   help="--observability: also run the proxy from this source tree (e.g. a git archive of main)")
    args = p.parse_args(argv)
    if args.cmd == "backend":
        uvloop.run(run_backend([int(x) for x in args.ports.split(",")], args.events, args.event_interval_ms,
                               args.otlp_port))
        return 0
    if args.cmd == "sse-client":
        uvloop.run(run_sse_client(args.host, args.port, args.path, args.concurrency, args.duration))
        return 0
    if args.observability:
        return main_observability(args)
    return main_bench(args)


if __name__ == "__main__":
    sys.exit(main())
