"""TLS cost, side by side in one run: direct to a TLS backend, nginx doing TLS both ways, affinity-proxy
doing TLS both ways (downstream `listen.tls`, upstream `https://` verified against the CA).

    python -m loadtest.bench_tls [--duration 5] [--no-nginx]

Figures (one process each, pinned to core 0; backend and load generator on core 1, as bench_proxy does):
  - CPU µs per request: wrk over https, 64 kept-alive connections, non-streaming POST; the proxy's CPU time
    over the load window / requests (the upstream connections are kept too: no handshake per request).
  - added p50 at concurrency 1: wrk -c1 through the proxy minus wrk -c1 direct to the TLS backend.
  - handshakes/s one worker sustains: wrk with `Connection: close`, 16 connections, so every request is a
    new TLS connection to the proxy (the upstream connection stays kept); handshakes/s = requests/s.
The certificates are made at start (trustme, the test extra). Compare the columns of one run: other
processes on the machine add noise, and the ratios (affinity-proxy / nginx) are what the run is for.

Subcommand `backend` is the TLS backend process this script starts itself (bench_proxy's canned-bytes
server behind TLS).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

import uvloop

from loadtest.bench_proxy import (  # the same backend, CPU accounting and pinning as the plaintext benchmark
    _UNITS, LOAD_CORE, PROXY_CORE, REQUEST_BODY, ROOT, Target, _FakeBackend, _measure, children, free_port,
    pinned, stop_procs, wait_port,
)


async def run_tls_backend(ports: Sequence[int], cert: str, key: str) -> None:
    import ssl

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    loop = asyncio.get_running_loop()
    streams: dict[_FakeBackend, int] = {}
    servers = [await loop.create_server(lambda: _FakeBackend(streams, 1), "127.0.0.1", p, backlog=4096,
                                        reuse_address=True, ssl=ctx) for p in ports]
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    print("ready", flush=True)
    await stop.wait()
    for s in servers:
        s.close()


def _wrk(port: int, connections: int, duration: float, lua: str, *, latency: bool = False,
         close: bool = False) -> tuple[float, dict[str, float]]:
    argv = ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(duration))}s", "-s", lua]
    if latency:
        argv.append("--latency")
    if close:
        argv += ["-H", "Connection: close"]
    argv.append(f"https://127.0.0.1:{port}/v1/chat/completions")
    out = subprocess.run(pinned(LOAD_CORE, argv), capture_output=True, text=True, check=True).stdout
    m = re.search(r"^\s*(\d+) requests in", out, re.M)
    if m is None:
        raise RuntimeError(f"unexpected wrk output:\n{out}")
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if errors:
        raise RuntimeError(f"wrk saw {errors.group(1)} error responses:\n{out}")
    pct = {p: float(v) * _UNITS[u] for p, v, u in re.findall(r"^\s+(50|99)%\s+([\d.]+)(us|ms|s)\s*$", out, re.M)}
    return float(m.group(1)), pct


def bench(target: Target, duration: float, lua: str) -> None:
    _wrk(target.port, 64, 1, lua)  # warm-up: connections (and their handshakes), caches
    (requests, _), cpu = _measure(target, lambda: _wrk(target.port, 64, duration, lua))  # type: ignore[misc]
    target.results["rps_c64"] = requests / duration
    target.results["cpu_us_per_request"] = cpu / requests * 1e6 if target.pids else float("nan")
    _, pct = _wrk(target.port, 1, duration, lua, latency=True)
    target.results["p50_us"] = pct.get("50", float("nan"))
    if not target.pids:
        return  # the canned-bytes backend ignores `Connection: close`: no handshake figure for "direct"
    (conns, _), cpu = _measure(target, lambda: _wrk(target.port, 16, duration, lua, close=True))  # type: ignore[misc]
    target.results["handshakes_per_s"] = conns / duration
    target.results["cpu_us_per_handshake"] = cpu / conns * 1e6 if target.pids and conns else float("nan")


NGINX_CONF = """daemon off;
master_process on;
worker_processes 1;
pid nginx.pid;
error_log logs/error.log warn;
events {{ worker_connections 16384; multi_accept on; }}
http {{
    access_log off;
    client_body_temp_path client_body;
    proxy_temp_path proxy;
    fastcgi_temp_path fastcgi;
    uwsgi_temp_path uwsgi;
    scgi_temp_path scgi;
    keepalive_requests 1000000;
    upstream llm {{
        server 127.0.0.1:{b1};
        server 127.0.0.1:{b2};
        keepalive 128;
    }}
    server {{
        listen 127.0.0.1:{port} ssl backlog=4096;
        ssl_certificate {cert};
        ssl_certificate_key {key};
        ssl_protocols TLSv1.2 TLSv1.3;
        location / {{
            proxy_pass https://llm;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_ssl_verify on;
            proxy_ssl_trusted_certificate {ca};
            proxy_ssl_name localhost;
            proxy_ssl_session_reuse on;
            proxy_buffering off;
            proxy_request_buffering off;
        }}
    }}
}}
"""


def main_bench(args: argparse.Namespace) -> int:
    import trustme

    if shutil.which("wrk") is None:
        print("wrk is required (Debian package `wrk`)", file=sys.stderr)
        return 2
    procs: list[subprocess.Popen[bytes]] = []
    tmp = Path(tempfile.mkdtemp(prefix="bench_tls_"))
    ca = trustme.CA()
    cert = ca.issue_cert("localhost", "127.0.0.1")
    chain, key, ca_file = tmp / "cert.pem", tmp / "key.pem", tmp / "ca.pem"
    cert.private_key_and_cert_chain_pem.write_to_path(str(chain))
    cert.private_key_pem.write_to_path(str(key))
    ca.cert_pem.write_to_path(str(ca_file))
    lua = tmp / "post.lua"
    lua.write_text('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
                   f"wrk.body = {json.dumps(REQUEST_BODY)}\n")
    try:
        b1, b2 = free_port(), free_port()
        backend = subprocess.Popen(pinned(LOAD_CORE, [sys.executable, "-m", "loadtest.bench_tls", "backend",
                                                      "--ports", f"{b1},{b2}", "--cert", str(chain), "--key", str(key)]),
                                   cwd=ROOT, stdout=subprocess.DEVNULL)
        procs.append(backend)
        wait_port(b1, backend)
        wait_port(b2, backend)
        targets = [Target("direct (TLS)", b1)]
        if not args.no_nginx and shutil.which("nginx"):
            nport = free_port()
            (tmp / "logs").mkdir()
            (tmp / "nginx.conf").write_text(NGINX_CONF.format(b1=b1, b2=b2, port=nport, cert=chain, key=key, ca=ca_file))
            nginx = subprocess.Popen(pinned(PROXY_CORE, ["nginx", "-p", str(tmp), "-c", str(tmp / "nginx.conf")]),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            procs.append(nginx)
            wait_port(nport, nginx)
            targets.append(Target("nginx TLS", nport, [nginx.pid, *children(nginx.pid)]))
        pport, aport = free_port(), free_port()
        cfg = tmp / "proxy.yaml"
        tls = f"{{cert_file: '{chain}', key_file: '{key}'}}"
        backends = "".join(f"  - {{name: b{i}, url: 'https://127.0.0.1:{p}', tls: {{ca_file: '{ca_file}'}}}}\n"
                           for i, p in enumerate((b1, b2)))
        cfg.write_text(f"listen: {{port: {pport}, tls: {tls}}}\nadmin: {{port: {aport}}}\n"
                       "routing: {policy: round_robin}\ntelemetry: {enabled: false}\nhealth_checks: {enabled: false}\n"
                       f"backends:\n{backends}")
        proxy = subprocess.Popen(pinned(PROXY_CORE, [sys.executable, "-m", "proxy", "run", "--config", str(cfg),
                                                     "--workers", "1", "--log-level", "warning"]), cwd=ROOT)
        procs.append(proxy)
        wait_port(pport, proxy)
        targets.append(Target("affinity-proxy TLS", pport, [proxy.pid]))
        for t in targets:
            print(f"... {t.name}", file=sys.stderr, flush=True)
            bench(t, args.duration, str(lua))
        print_table(targets, args)
        return 0
    finally:
        stop_procs(procs)
        shutil.rmtree(tmp, ignore_errors=True)


def print_table(targets: list[Target], args: argparse.Namespace) -> None:
    direct = targets[0].results
    rows = [("requests/s, c64 kept-alive", "rps_c64", "{:.0f}"), ("CPU µs per request (c64)", "cpu_us_per_request", "{:.1f}"),
            ("p50 latency c1 (µs)", "p50_us", "{:.0f}"), ("new TLS connections/s (c16, close)", "handshakes_per_s", "{:.0f}"),
            ("CPU µs per new connection", "cpu_us_per_handshake", "{:.0f}")]
    width = max(len(t.name) for t in targets) + 2
    print(f"\nbench_tls: {args.duration:g} s per measurement; proxies on core {PROXY_CORE}, backend + load on core {LOAD_CORE}")
    print(f"{'':36}" + "".join(f"{t.name:>{width}}" for t in targets))
    for label, key, fmt in rows:
        cells = ["-" if t.results.get(key, float("nan")) != t.results.get(key, float("nan"))
                 else fmt.format(t.results[key]) for t in targets]
        print(f"{label:36}" + "".join(f"{c:>{width}}" for c in cells))
    print(f"{'added p50 latency c1 (µs)':36}" + "".join(
        f"{c:>{width}}" for c in ["-"] + [f"{t.results['p50_us'] - direct['p50_us']:.0f}" for t in targets[1:]]))
    names = {t.name: t.results for t in targets}
    if "nginx TLS" in names:
        ours, theirs = names["affinity-proxy TLS"], names["nginx TLS"]
        print(f"ratios affinity-proxy / nginx: CPU per request {ours['cpu_us_per_request'] / theirs['cpu_us_per_request']:.2f}x, "
              f"added p50 {(ours['p50_us'] - direct['p50_us']) / max(1.0, theirs['p50_us'] - direct['p50_us']):.2f}x, "
              f"CPU per new connection {ours['cpu_us_per_handshake'] / theirs['cpu_us_per_handshake']:.2f}x")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_tls", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd")
    b = sub.add_parser("backend")
    b.add_argument("--ports", required=True)
    b.add_argument("--cert", required=True)
    b.add_argument("--key", required=True)
    p.add_argument("--duration", type=int, default=5, help="seconds per measurement (default 5)")
    p.add_argument("--no-nginx", action="store_true")
    args = p.parse_args(argv)
    if args.cmd == "backend":
        uvloop.run(run_tls_backend([int(x) for x in args.ports.split(",")], args.cert, args.key))
        return 0
    return main_bench(args)


if __name__ == "__main__":
    sys.exit(main())
