"""Side by side with the Rust LLM routers and nginx: the five rows of issue 19, in one run, with ratios.

The harness is /work/shared/peers/bench.py (process start/stop by PID, /proc CPU accounting, wrk and the
aiohttp SSE client as load, fake OpenAI backends); this script reuses it unchanged (imported from
`--peers-dir`, read-only) and only changes what a shared machine needs:

- every port is moved by `--port-base` (default 28000 instead of 18000), so that this run does not collide
  with another engineer's run of the shared harness on the same machine; the nginx config and the
  affinity-proxy configs are rewritten for those ports into the run folder;
- the "quiet gate" of the harness (wait until foreign CPU < 25 %) is off by default (`--other-max`): on a
  machine shared by several engineers it would wait 45 s before every point; numbers are noisy, so read the
  ratios WITHIN one run and repeat a comparison before believing it;
- `--ap-bin` picks the affinity-proxy under test, `--label` names it in the output (e.g. before/after).

Each proxy is pinned alone on core 0 (`taskset`), backends and load on core 1; `run --workers 1`.

The five rows (per proxy core): CPU µs per small POST (wrk -c64, scenario a), added p50 and p99 at one
connection (wrk -c1, scenario c, minus direct in the same repetition), CPU µs per SSE event (256 paced
streams, scenario d), extra time to the first SSE event (4 streams, scenario t, TTFB minus direct's).

    ~/.cache/peers/venv/bin/python loadtest/bench_peers.py --reps 3 --duration 4 --ap-bin .venv/bin/affinity-proxy

It prints progress on stderr and the table (markdown) on stdout; the raw JSON goes to `--results`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, NamedTuple

COLUMNS = ["nginx", "vllm-rr", "sglang-rr", "sglang-cache", "vllm-cache", "ap-rr-base", "ap-aff-base", "ap-rr", "ap-aff",
           "ap-rr-nolog", "ap-aff-nolog", "ap-rr-alt", "ap-aff-alt", "ap-rr-nolog-alt", "ap-aff-nolog-alt"]
DEFAULT_TARGETS = "direct,nginx,vllm-rr,sglang-rr,sglang-cache,ap-rr,ap-aff"


def load_harness(peers_dir: str):  # type: ignore[no-untyped-def]  # the harness module is untyped
    spec = importlib.util.spec_from_file_location("peers_bench", os.path.join(peers_dir, "bench.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class RunEnv(NamedTuple):
    """What every benchmark of this file starts from (`run_env`)."""
    hz: int  # clock ticks per second of /proc's CPU times
    py: str  # the Python of --ap-bin's venv (runs the proxies under test)
    venv: str  # the peers' venv (the Rust routers, the fake backends)
    fake_py: str
    run_dir: str
    harness: Any  # the peers' bench.py, its fake tokenizer made under run_dir


def write_ap_config(path: str, port: int, admin_port: int, backend_urls: list[str], policy: str, *,
                    listen_extra: str = "", tail: str = "") -> str:
    """An affinity-proxy config for a benchmark target: listen on `port` (plus `listen_extra` inside the
    listen map, e.g. its TLS files), admin on `admin_port`, the backends be0.. at `backend_urls`, `policy`,
    then `tail` (more top-level YAML). Returns `path`."""
    with open(path, "w") as f:
        f.write(f"listen: {{host: 127.0.0.1, port: {port}{listen_extra}}}\n"
                f"admin: {{host: 127.0.0.1, port: {admin_port}}}\nbackends:\n"
                + "".join(f"  - {{name: be{i}, url: '{u}'}}\n" for i, u in enumerate(backend_urls))
                + f"routing: {{policy: {policy}}}\n" + tail)
    return path


def native_state() -> dict[str, object]:
    """What this tree's affinity-proxy targets ran: its compiled hot path (proxy/native) or its Python source
    (the `-src` targets always run the source). Recorded in every raw result."""
    import importlib.util

    # By its file: this script runs on the peers' interpreter, where the tree is no installed package.
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "proxy", "native", "loader.py")
    spec = importlib.util.spec_from_file_location("_tree_native_loader", path)
    assert spec is not None and spec.loader is not None
    loader = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = loader  # (its dataclass looks its module up there)
    spec.loader.exec_module(loader)
    found, _ = loader.check(env={})
    return {"native": found.label(), "reason": found.reason, "modules": len(found.modules),
            "built_with": found.built_with}


def ap_target(name: str) -> tuple[str, bool, str] | None:
    """An affinity-proxy target's (policy, access log off, variant) from its name: `ap-rr` / `ap-aff`, then
    optionally `-nolog`, then optionally `-base` (the --baseline tree), `-alt` (the --alt-python
    interpreter) or `-src` (this tree's Python source: AFFINITY_PROXY_NATIVE=0, without its compiled hot
    path); variant "" is this tree on --ap-bin's interpreter. None: not an affinity-proxy target."""
    parts = name.split("-")
    if len(parts) < 2 or parts[0] != "ap" or parts[1] not in ("rr", "aff"):
        return None
    rest = parts[2:]
    nolog = bool(rest) and rest[0] == "nolog"
    if nolog:
        rest = rest[1:]
    if len(rest) > 1 or (rest and rest[0] not in ("base", "alt", "src")):
        return None
    return ("round_robin" if parts[1] == "rr" else "affinity"), nolog, rest[0] if rest else ""


def run_env(peers_dir: str, ap_bin: str, name: str, *, fresh: bool = False) -> RunEnv:
    """The run folder `name` under $PEERS_RUN (emptied first when `fresh`), the interpreters, and the peers'
    harness with its fake tokenizer there."""
    venv = os.environ.get("PEERS_VENV", os.path.expanduser("~/.cache/peers/venv"))
    run_dir = os.path.join(os.environ.get("PEERS_RUN", os.path.expanduser("~/.cache/peers")), name)
    if fresh:
        shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir, exist_ok=True)
    b = load_harness(peers_dir)
    b.TOKDIR = os.path.join(run_dir, "fake-tokenizer")
    b.ensure_tokenizer()
    return RunEnv(os.sysconf("SC_CLK_TCK"), os.path.join(os.path.dirname(os.path.abspath(ap_bin)), "python"), venv,
                  os.path.join(venv, "bin", "python"), run_dir, b)


def configure(b, base: int, ap_bin: str, run_dir: str, other_max: float,  # type: ignore[no-untyped-def]
              baseline: str | None = None) -> None:
    """Move every port of the harness by `base - 18000` and write the configs that name ports."""
    shift = base - 18000
    b.BACKENDS = [18001 + shift, 18002 + shift]
    b.W = ["http://127.0.0.1:%d" % p for p in b.BACKENDS]
    b.OTHER_MAX = other_max
    b.AP = ap_bin
    os.makedirs(run_dir + "/nginx/logs", exist_ok=True)
    with open(os.path.join(b.HERE, "nginx.conf")) as f:
        conf = f.read()
    for old in (18100, 18001, 18002):
        conf = conf.replace("127.0.0.1:%d" % old, "127.0.0.1:%d" % (old + shift))
    nginx_conf = os.path.join(run_dir, "nginx.conf")
    with open(nginx_conf, "w") as f:
        f.write(conf)
    aps = {}
    for name, policy, port in (("ap-rr", "round_robin", 18108), ("ap-aff", "affinity", 18109)):
        path = write_ap_config(os.path.join(run_dir, name + ".yaml"), port + shift, port + 100 + shift, b.W, policy)
        aps[name] = (port + shift, [ap_bin, "run", "--config", path, "--workers", "1"], "absdtc")
        # The same tree on its Python source (AFFINITY_PROXY_NATIVE=0: no compiled hot path), on other ports.
        src_path = os.path.join(run_dir, name + "-src.yaml")
        write_ap_config(src_path, port + 20 + shift, port + 120 + shift, b.W, policy)
        aps[name + "-src"] = (port + 20 + shift, ["env", "AFFINITY_PROXY_NATIVE=0", ap_bin, "run", "--config",
                                                  src_path, "--workers", "1"], "absdtc")
        # The same config on other ports, run from another source tree (python -P: the current folder, this
        # tree, must not come before PYTHONPATH on sys.path).
        if baseline is not None:
            base_path = os.path.join(run_dir, name + "-base.yaml")
            with open(path) as f:
                text = f.read()
            with open(base_path, "w") as f:
                f.write(text.replace(str(port + shift), str(port + 10 + shift))
                        .replace(str(port + 100 + shift), str(port + 110 + shift)))
            aps[name + "-base"] = (port + 10 + shift, [
                "env", f"PYTHONPATH={baseline}", os.path.join(os.path.dirname(ap_bin), "python"), "-P", "-m", "proxy",
                "run", "--config", base_path,
                "--workers", "1"], "absdtc")
    t = b.TARGETS
    t["direct"] = (b.BACKENDS[0], None, "absdtc")
    t["nginx"] = (18100 + shift, ["nginx", "-p", run_dir + "/nginx", "-c", nginx_conf], "absdtc")
    t["sglang-rr"] = (18102 + shift, b.sglang(18102 + shift, "round_robin"), "absdtc")
    t["sglang-cache"] = (18103 + shift, b.sglang(18103 + shift, "cache_aware"), "absdtc")
    t["vllm-rr"] = (18104 + shift, b.vllm(18104 + shift, "round_robin"), "absdtc")
    t["vllm-cache"] = (18105 + shift, b.vllm(18105 + shift, "cache_aware"), "absdtc")
    t.update(aps)
    for gone in ("haproxy", "aiohttp-mini", "sglang-rr-info"):
        t.pop(gone, None)


def five_rows(raw: dict) -> dict[str, dict[str, float | None]]:
    """Per target: the issue's five numbers (medians over repetitions; 'added' paired within a repetition)."""
    res = raw["results"]
    out: dict[str, dict[str, float | None]] = {}

    def med(xs: list[float]) -> float | None:
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None

    def per_unit(s: str, n: str, key: str) -> float | None:
        return med([(r["cpu"]["proxy"] / 100.0) / r[key] * 1e6 for r in res.get(s, {}).get(n, [])
                    if r.get("cpu", {}).get("proxy") is not None and r.get(key)])

    def added(s: str, n: str, key: str, scale: float) -> float | None:
        direct = {r["rep"]: r for r in res.get(s, {}).get("direct", [])}
        return med([(r[key] - direct[r["rep"]][key]) * scale for r in res.get(s, {}).get(n, [])
                    if r["rep"] in direct and r.get(key) is not None])

    for n in raw["targets"]:
        if n == "direct":
            continue
        out[n] = {
            "cpu_req": per_unit("a", n, "rps"),
            "p50": added("c", n, "p50_us", 1.0),
            "p99": added("c", n, "p99_us", 1.0),
            "cpu_event": per_unit("d", n, "events_per_s"),
            "ttfe": added("t", n, "ttfb_p50_ms", 1.0),
        }
    return out


def table(rows: dict[str, dict[str, float | None]], label: str) -> str:
    names = [n for n in COLUMNS if n in rows]
    head = ["per proxy core"] + [n if not n.startswith("ap-") else f"**{n}**" if n.endswith("-base") else
                                 f"**{n}** ({label})" for n in names]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    spec = [("CPU µs per small POST, 64 connections", "cpu_req", "%.1f"),
            ("added p50 at 1 connection (µs)", "p50", "%.0f"),
            ("added p99 at 1 connection (µs)", "p99", "%.0f"),
            ("CPU µs per SSE event (256 paced streams)", "cpu_event", "%.1f"),
            ("extra time to first SSE event, 4 streams (ms)", "ttfe", "%+.2f")]
    for title, key, fmt in spec:
        cells = [("-" if rows[n][key] is None else fmt % rows[n][key]) for n in names]
        lines.append("| " + " | ".join([title] + cells) + " |")
    return "\n".join(lines)


def ratios(rows: dict[str, dict[str, float | None]]) -> str:
    """The issue's checks: ours against the peer each target names."""
    def r(a: str, b: str, key: str) -> str:
        x, y = rows.get(a, {}).get(key), rows.get(b, {}).get(key)
        if x is None or y is None or y <= 0:
            return "-"
        return "%.2f×" % (x / y)

    checks = [
        ("CPU/request: ap-rr vs vllm-rr (target ≤ 1)", r("ap-rr", "vllm-rr", "cpu_req")),
        ("CPU/request: ap-aff vs sglang-cache (target ≤ 1)", r("ap-aff", "sglang-cache", "cpu_req")),
        ("CPU/request: ap-rr vs nginx", r("ap-rr", "nginx", "cpu_req")),
        ("added p50: ap-rr vs vllm-rr (target ≤ 1)", r("ap-rr", "vllm-rr", "p50")),
        ("added p50: ap-aff vs vllm-rr (target ≤ 1)", r("ap-aff", "vllm-rr", "p50")),
        ("added p99: ap-rr vs vllm-rr (target ≤ 1.2)", r("ap-rr", "vllm-rr", "p99")),
        ("added p99: ap-aff vs vllm-rr (target ≤ 1.2)", r("ap-aff", "vllm-rr", "p99")),
        ("CPU/event: ap-rr vs sglang-rr (target ≤ 1)", r("ap-rr", "sglang-rr", "cpu_event")),
        ("CPU/event: ap-aff vs sglang-rr (target ≤ 1)", r("ap-aff", "sglang-rr", "cpu_event")),
    ]
    if "ap-rr-base" in rows:
        checks += [
            ("CPU/request: ap-rr vs ap-rr-base (this tree vs the baseline)", r("ap-rr", "ap-rr-base", "cpu_req")),
            ("CPU/request: ap-aff vs ap-aff-base", r("ap-aff", "ap-aff-base", "cpu_req")),
            ("added p50: ap-rr vs ap-rr-base", r("ap-rr", "ap-rr-base", "p50")),
            ("added p50: ap-aff vs ap-aff-base", r("ap-aff", "ap-aff-base", "p50")),
            ("CPU/event: ap-rr vs ap-rr-base", r("ap-rr", "ap-rr-base", "cpu_event")),
        ]
    lines = ["| check | ratio |", "|---|---|"] + [f"| {a} | {b} |" for a, b in checks]
    for n in ("ap-rr", "ap-aff"):
        v = rows.get(n, {}).get("ttfe")
        lines.append(f"| extra time to first SSE event, {n} (target ≤ +0.5 ms) | "
                     f"{'-' if v is None else '%+.2f ms' % v} |")
    return "\n".join(lines)



def ab_arms_up(start: Callable[..., int], peers_dir: str, py: str, fake_py: str, tokdir: str, run_dir: str,
               base_port: int, baseline: str, policy: str, *, chunks: int,
               listen_extra: str = "") -> tuple[dict[str, int], dict[str, int]]:
    """The two arms of an A/B: two fake backends on core 1 (`chunks` SSE chunks each), and the baseline
    tree's and this tree's proxy (`run --workers 1`, `policy`, `listen_extra` appended to the listen
    section, e.g. its TLS files) on core 0. Returns each arm's port and pid."""
    trees = {"base": os.path.abspath(baseline), "this": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    backends = [base_port + 1, base_port + 2]
    ports = {"base": base_port + 11, "this": base_port + 12}
    for port in backends:
        start([fake_py, os.path.join(peers_dir, "fake_backend.py"), "--port", str(port), "--chunks", str(chunks),
               "--model-path", tokdir], "1")
    pids = {}
    for name, tree in trees.items():
        cfg = write_ap_config(os.path.join(run_dir, f"{name}.yaml"), ports[name], ports[name] + 100,
                              [f"http://127.0.0.1:{p}" for p in backends], policy, listen_extra=listen_extra)
        pids[name] = start([py, "-P", "-m", "proxy", "run", "--config", cfg, "--workers", "1"], "0",
                           dict(os.environ, PYTHONPATH=tree))
    time.sleep(6)
    return ports, pids


def ab_cpu(peers_dir: str, baseline: str, ap_bin: str, policy: str, reps: int, conns: int, base_port: int) -> None:
    """This tree against `baseline`, the two proxies up side by side, wrk runs of 3 s alternating between
    them (ABBA order); CPU µs per request of each proxy's process tree (/proc) and wrk's p50, medians.
    Both share every disturbance of a busy machine, so their ratio is steadier than the full run's."""

    hz, py, _venv, fake_py, run_dir, b = run_env(peers_dir, ap_bin, f"ab-{base_port}")
    lua = os.path.join(peers_dir, "post_completions.lua")
    tok = b.TOKDIR
    procs: list[subprocess.Popen[bytes]] = []
    logf = open(os.path.join(run_dir, "ab.log"), "a")

    def start(cmd: list[str], cpus: str, env: dict[str, str] | None = None) -> int:
        p = subprocess.Popen(["taskset", "-c", cpus, *cmd], stdout=logf, stderr=logf, env=env, start_new_session=True)
        procs.append(p)
        return p.pid

    try:
        ports, pids = ab_arms_up(start, peers_dir, py, fake_py, tok, run_dir, base_port, baseline, policy, chunks=200)

        def wrk(port: int, secs: int) -> dict[str, float]:
            out = subprocess.run(["taskset", "-c", "1", "wrk", "-t1" if conns == 1 else "-t2", f"-c{conns}",
                                  f"-d{secs}s", "--latency", "-s", lua, f"http://127.0.0.1:{port}"],
                                 capture_output=True, text=True).stdout
            return b.parse_result(out)  # type: ignore[no-any-return]  # the harness is untyped

        for name in ports:
            wrk(ports[name], 2)  # warm-up
        res: dict[str, list[tuple[float, float]]] = {n: [] for n in ports}
        for rep in range(reps):
            for name in (list(ports) if rep % 2 == 0 else list(ports)[::-1]):
                t0 = b.cpu_ticks(b.tree(pids[name]))
                r = wrk(ports[name], 3)
                t1 = b.cpu_ticks(b.tree(pids[name]))
                res[name].append(((t1 - t0) / hz / r["requests"] * 1e6, r["p50_us"]))
                b.log(f"ab {policy} c{conns} rep{rep} {name}: {res[name][-1][0]:.1f} µs CPU/req, p50 {r['p50_us']:.0f} µs")
        med = {n: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)) for n, v in res.items()}
        print(f"| {policy}, wrk -c{conns}, {reps}× 3 s alternating | baseline | this tree | ratio |\n|---|---|---|---|")
        print(f"| CPU µs per request | {med['base'][0]:.1f} | {med['this'][0]:.1f} | {med['this'][0] / med['base'][0]:.2f}× |")
        print(f"| p50 µs (wrk) | {med['base'][1]:.0f} | {med['this'][1]:.0f} | {med['this'][1] / med['base'][1]:.2f}× |")
        # Each round measured both back to back: the median of the per-round ratios is the least swayed by
        # a round that a burst of foreign load hit (on a machine at load 13-16 one side of a round can
        # read 2-3x its neighbours).
        pairs = sorted(t[0] / bb[0] for t, bb in zip(res["this"], res["base"]))
        lower = sum(1 for x in pairs if x < 1.0)
        print(f"| CPU/request, median of the {len(pairs)} per-round ratios (this lower in {lower}) | | | "
              f"{statistics.median(pairs):.2f}× |")
    finally:
        stop_groups(procs)


NGINX_EXTRA = """daemon off;
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
    http2_max_requests 1000000;
    upstream llm {{
        server 127.0.0.1:{b0};
        server 127.0.0.1:{b1};
        keepalive 128;
        keepalive_requests 1000000;
        keepalive_timeout 60s;
    }}
    server {{
        listen 127.0.0.1:{h1} backlog=4096;
        listen 127.0.0.1:{h2c} http2 backlog=4096;
        listen 127.0.0.1:{tls} ssl backlog=4096;
        ssl_certificate {cert};
        ssl_certificate_key {key};
        location / {{
            proxy_pass http://llm;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 3600s;
        }}
    }}
}}
"""

# The body h2load sends (every request the same: for the affinity policy these are exact repeats).
H2_BODY = (b'{"model":"fake-model","prompt":"System prompt 1: You are a helpful assistant. ' + b"a" * 150 +
           b' user question 0-1","max_tokens":16,"temperature":0}')


def parse_h2load(out: str) -> dict[str, float]:
    """h2load's summary: requests succeeded and the run's time (its -D duration, or 'finished in')."""
    m = re.search(r"requests: \d+ total, \d+ started, \d+ done, (\d+) succeeded", out)
    t = re.search(r"finished in ([\d.]+)(m?s)", out)
    if m is None or t is None:
        raise RuntimeError("unexpected h2load output:\n" + out[-2000:])
    secs = float(t.group(1)) / (1000.0 if t.group(2) == "ms" else 1.0)
    return {"requests": float(m.group(1)), "rps": float(m.group(1)) / secs if secs else 0.0}


def c1_latencies(port: int, secs: float, tls: bool = False) -> dict[str, float]:
    """One connection, one request at a time, for `secs`: every request's latency as this client sees it
    (perf_counter around send + read of the whole answer), p50/p99/p99.9 over all of them.

    Not wrk's -c1 figures: wrk corrects for coordinated omission, adding synthetic samples for every
    request slower than twice the mean interval, so that one 0.5 s stall of a busy machine in a 10 s run at
    c=1 becomes thousands of samples and its "p99" is the stall (direct's p99 read 673 ms in a run of
    137,800 requests, which cannot be a 1 % tail). Here a stall is one slow sample. The bodies are those of
    post_completions.lua (8 shared prefixes, a unique suffix)."""
    import socket
    import ssl

    prefixes = [f"System prompt {i}: You are a helpful assistant. " + chr(96 + i) * 150 for i in range(1, 9)]
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if tls:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        sock = ctx.wrap_socket(sock, server_hostname="127.0.0.1")
    lat: list[float] = []
    clock = time.perf_counter_ns
    end = time.monotonic() + secs
    n = 0
    buf = b""
    try:
        while time.monotonic() < end:
            n += 1
            body = ('{"model":"fake-model","prompt":"%s user question c1-%d","max_tokens":16,"temperature":0}'
                    % (prefixes[n % 8], n)).encode()
            req = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            t0 = clock()
            sock.sendall(req)
            while b"\r\n\r\n" not in buf:
                chunk = sock.recv(65536)
                if not chunk:
                    raise RuntimeError("connection closed")
                buf += chunk
            head, _, buf = buf.partition(b"\r\n\r\n")
            lower = head.lower()
            if b"transfer-encoding: chunked" in lower:
                while b"\r\n0\r\n\r\n" not in buf and not buf.startswith(b"0\r\n\r\n"):
                    buf += sock.recv(65536)
                buf = buf.split(b"0\r\n\r\n", 1)[1] if buf.startswith(b"0\r\n\r\n") else buf.split(b"\r\n0\r\n\r\n", 1)[1]
            else:
                length = int(lower.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
                while len(buf) < length:
                    buf += sock.recv(65536)
                buf = buf[length:]
            lat.append((clock() - t0) / 1000.0)
    finally:
        sock.close()
    lat.sort()

    def q(p: float) -> float:
        return lat[min(len(lat) - 1, int(p * len(lat)))]

    return {"requests": float(len(lat)), "p50_us": q(0.50), "p99_us": q(0.99), "p999_us": q(0.999)}


def ab_h2(peers_dir: str, baseline: str, ap_bin: str, policy: str, reps: int, conns: int, streams: int,
          tls: bool, base_port: int, secs: int = 3) -> dict[str, Any]:
    """This tree against `baseline` over HTTP/2: h2c with prior knowledge, or h2 over TLS (ALPN) when `tls`.

    As `ab_cpu` for HTTP/1.1: both proxies up side by side, pinned to core 0 (backends and load on core 1),
    h2load runs of `secs` alternating between them (ABBA order), `conns` connections x `streams`
    concurrent streams, the `H2_BODY` POST to /v1/completions; CPU µs per request of each proxy's process
    tree (/proc). Printed: the medians and the median of the per-round ratios (the least swayed by a round
    a burst of foreign load hit). Returns the raw rounds."""

    hz, py, _venv, fake_py, run_dir, b = run_env(peers_dir, ap_bin, f"ab-h2-{base_port}")
    body_file = os.path.join(run_dir, "body.json")
    with open(body_file, "wb") as bf:
        bf.write(H2_BODY)
    cert, key = os.path.join(run_dir, "cert.pem"), os.path.join(run_dir, "key.pem")
    if tls:
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                        "-nodes", "-keyout", key, "-out", cert, "-days", "2", "-subj", "/CN=127.0.0.1",
                        "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    procs: list[subprocess.Popen[bytes]] = []
    logf = open(os.path.join(run_dir, "ab.log"), "a")

    def start(cmd: list[str], cpus: str, env: dict[str, str] | None = None) -> int:
        p = subprocess.Popen(["taskset", "-c", cpus, *cmd], stdout=logf, stderr=logf, env=env, start_new_session=True)
        procs.append(p)
        return p.pid

    scheme = "https" if tls else "http"
    proto = "h2 (TLS)" if tls else "h2c"
    try:
        tls_line = f", tls: {{cert_file: '{cert}', key_file: '{key}'}}" if tls else ""
        ports, pids = ab_arms_up(start, peers_dir, py, fake_py, b.TOKDIR, run_dir, base_port, baseline, policy,
                                 chunks=16, listen_extra=tls_line)

        def h2load(port: int, duration: int) -> dict[str, float]:
            out = subprocess.run(["taskset", "-c", "1", "h2load", "-t1", f"-c{conns}", f"-m{streams}", "-D",
                                  str(duration), "-d", body_file, "-H", "content-type: application/json",
                                  f"{scheme}://127.0.0.1:{port}/v1/completions"], capture_output=True, text=True).stdout
            r = parse_h2load(out)
            if r["requests"] <= 0:
                raise RuntimeError(f"no request succeeded on port {port}:\n" + out[-1500:])
            return r

        for name in ports:
            h2load(ports[name], 2)  # warm-up
        res: dict[str, list[float]] = {n: [] for n in ports}
        for rep in range(reps):
            for name in (list(ports) if rep % 2 == 0 else list(ports)[::-1]):
                pids_now = b.tree(pids[name])
                t0 = b.cpu_ticks(pids_now)
                r = h2load(ports[name], secs)
                t1 = b.cpu_ticks(pids_now)
                res[name].append((t1 - t0) / hz / r["requests"] * 1e6)
                b.log(f"ab-h2 {proto} {policy} c{conns}x{streams} rep{rep} {name}: {res[name][-1]:.1f} µs CPU/req, "
                      f"{r['rps']:.0f} req/s")
        med = {n: statistics.median(v) for n, v in res.items()}
        pairs = sorted(t / bb for t, bb in zip(res["this"], res["base"]))
        lower = sum(1 for x in pairs if x < 1.0)
        print(f"| {policy}, {proto}, h2load -c{conns} -m{streams}, {reps}× {secs} s alternating | baseline | this tree "
              f"| ratio |\n|---|---|---|---|")
        print(f"| CPU µs per request | {med['base']:.1f} | {med['this']:.1f} | {med['this'] / med['base']:.2f}× |")
        print(f"| CPU/request, median of the {len(pairs)} per-round ratios (this lower in {lower}) | | | "
              f"{statistics.median(pairs):.2f}× |")
        return {"policy": policy, "proto": proto, "conns": conns, "streams": streams, "rounds": res}
    finally:
        stop_groups(procs)



def stop_groups(procs: list[subprocess.Popen[Any]], paused: bool = False) -> None:
    """SIGTERM every process group started here (each target runs in its own session, so its children go
    too), SIGCONT first where arms may be stopped (`ab_c1` pauses idle arms), and SIGKILL the groups that
    have not exited within 15 s."""
    for proc in procs:
        try:
            if paused:
                os.killpg(proc.pid, signal.SIGCONT)
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for proc in procs:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def extra_rows(peers_dir: str, ap_bin: str, reps: int, base_port: int, c1_secs: int, load_secs: int,
               names: list[str], rows: frozenset[str] = frozenset({"c1", "cpu", "h2c", "tls"}),
               baseline: str | None = None, pause_idle: bool = False,
               alt_python: str | None = None) -> dict[str, object]:
    """The rows the main run lacks, side by side in one run (each proxy pinned alone on core 0; backends and
    load on core 1; targets alternate their order every repetition):

    - p50, p99 and p99.9 at one connection over HTTP/1.1, from `c1_secs` seconds of `c1_latencies` each
      (thousands of requests, every one a sample, none synthetic), with direct's beside them;
    - CPU µs per small POST over HTTP/1.1 (wrk -c64), over h2c with prior knowledge (h2load, 16
      connections x 4 streams, the same body every time) and over TLS (wrk https -c64, TLS at the proxy
      only: every proxy talks plain HTTP/1.1 to the backends);
    - p50 and p99 at one connection over TLS (minus direct's plain-HTTP figures: the TLS cost included).
    A target that does not speak a protocol (h2c refused, or no TLS option) shows '-'. `rows`: which of
    c1 (HTTP/1.1 at one connection), cpu (HTTP/1.1 at 64), h2c, tls to measure. `ap-rr-base` and
    `ap-aff-base` run the source tree `baseline` (e.g. the branch point) beside this one; `ap-rr-nolog` and
    `ap-aff-nolog` run this tree without its access log (`logging.access_log.enabled: false`), as the peers
    here run (nginx `access_log off`, the Rust routers at warn level: no line per request). A target with
    the suffix `-alt` (`ap-rr-alt`, `ap-aff-nolog-alt`, ...) runs this tree on the interpreter `alt_python`
    (another build of Python, e.g. the distribution's PGO+LTO one) instead of `--ap-bin`'s."""
    hz, py, venv, fake_py, run_dir, b = run_env(peers_dir, ap_bin, f"extra-{base_port}", fresh=True)
    lua = os.path.join(peers_dir, "post_completions.lua")
    os.makedirs(run_dir + "/nginx/logs", exist_ok=True)
    cert, key = os.path.join(run_dir, "cert.pem"), os.path.join(run_dir, "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", key, "-out", cert, "-days", "2", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    body_file = os.path.join(run_dir, "body.json")
    with open(body_file, "wb") as bf:
        bf.write(H2_BODY)
    backends = [base_port + 1, base_port + 2]
    workers = ["http://127.0.0.1:%d" % p for p in backends]
    procs: list[subprocess.Popen[bytes]] = []
    logf = open(os.path.join(run_dir, "extra.log"), "a")

    def start(cmd: list[str], cpus: str, env: dict[str, str] | None = None) -> int:
        p = subprocess.Popen(["taskset", "-c", cpus, *cmd], stdout=logf, stderr=logf, env=env,
                             start_new_session=True, cwd=run_dir)
        procs.append(p)
        return p.pid

    def ap_config(name: str, policy: str, port: int, tls: bool) -> str:
        return write_ap_config(
            os.path.join(run_dir, name + ".yaml"), port, port + 1000, list(workers), policy,
            listen_extra=f", tls: {{cert_file: '{cert}', key_file: '{key}'}}" if tls else "",
            tail="logging: {access_log: {enabled: false}}\n" if "-nolog" in name else "")

    # name -> {protocol: (port, pid)}; direct: the first backend (plain HTTP/1.1 only).
    ports: dict[str, dict[str, tuple[int, int]]] = {"direct": {}}
    os.sched_setaffinity(0, {1})  # this process is the 1-connection client: on the load core, like wrk
    try:
        for port in backends:
            pid = start([fake_py, os.path.join(peers_dir, "fake_backend.py"), "--port", str(port), "--chunks", "16",
                         "--model-path", b.TOKDIR], "1")
        ports["direct"]["h1"] = (backends[0], pid)
        p = base_port + 10
        if "nginx" in names:
            conf = os.path.join(run_dir, "nginx.conf")
            with open(conf, "w") as nf:
                nf.write(NGINX_EXTRA.format(b0=backends[0], b1=backends[1], h1=p, h2c=p + 1, tls=p + 2,
                                           cert=cert, key=key))
            pid = start(["nginx", "-p", run_dir + "/nginx", "-c", conf], "0")
            ports["nginx"] = {"h1": (p, pid), "h2c": (p + 1, pid), "tls": (p + 2, pid)}
        for name, cmd_of in (("vllm-rr", lambda port: [os.path.join(venv, "bin", "vllm-router"), "--host", "127.0.0.1",
                                                       "--port", str(port), "--prometheus-host", "127.0.0.1",
                                                       "--prometheus-port", str(port + 1000), "--worker-urls",
                                                       *workers, "--policy", "round_robin", "--log-level", "warning"]),
                             ("sglang-rr", lambda port: [fake_py, "-m", "sglang_router.launch_router", "--host",
                                                         "127.0.0.1", "--port", str(port), "--prometheus-host",
                                                         "127.0.0.1", "--prometheus-port", str(port + 1000),
                                                         "--worker-urls", *workers, "--policy", "round_robin",
                                                         "--log-level", "warn"]),
                             ("sglang-cache", lambda port: [fake_py, "-m", "sglang_router.launch_router", "--host",
                                                            "127.0.0.1", "--port", str(port), "--prometheus-host",
                                                            "127.0.0.1", "--prometheus-port", str(port + 1000),
                                                            "--worker-urls", *workers, "--policy", "cache_aware",
                                                            "--log-level", "warn"])):
            if name not in names:
                continue
            p += 10
            pid = start(cmd_of(p), "0")
            ports[name] = {"h1": (p, pid), "h2c": (p, pid)}
            if name == "sglang-rr":  # vllm-router has no server TLS option (its --help lists none)
                tls_pid = start(cmd_of(p + 2) + ["--tls-cert-path", cert, "--tls-key-path", key], "0")
                ports[name]["tls"] = (p + 2, tls_pid)
        this_tree = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        for name in names:
            target = ap_target(name)
            if target is None:
                continue
            policy, _nolog, variant = target
            if variant == "base" and baseline is None:
                raise SystemExit(f"{name} needs --baseline")
            if variant == "alt" and alt_python is None:
                raise SystemExit(f"{name} needs --alt-python")
            p += 10
            env = dict(os.environ, PYTHONPATH=baseline if variant == "base" and baseline else this_tree)
            if variant == "src":
                env["AFFINITY_PROXY_NATIVE"] = "0"
            interp = alt_python if variant == "alt" else py
            assert interp is not None  # checked above
            pid = start([interp, "-P", "-m", "proxy", "run", "--config", ap_config(name, policy, p, False),
                         "--workers", "1"], "0", env)
            tls_pid = start([interp, "-P", "-m", "proxy", "run", "--config",
                             ap_config(name + "-tls", policy, p + 2, True), "--workers", "1"], "0", env)
            ports[name] = {"h1": (p, pid), "h2c": (p, pid), "tls": (p + 2, tls_pid)}
        time.sleep(12)

        def wrk(url: str, conns: int, secs: int) -> dict[str, float]:
            out = subprocess.run(["taskset", "-c", "1", "wrk", "-t1" if conns == 1 else "-t2", f"-c{conns}",
                                  f"-d{secs}s", "--latency", "-s", lua, url], capture_output=True, text=True).stdout
            return b.parse_result(out)

        def h2load(port: int, secs: int) -> dict[str, float]:
            out = subprocess.run(["taskset", "-c", "1", "h2load", "-t1", "-c16", "-m4", "-D", str(secs),
                                  "-d", body_file, "-H", "content-type: application/json",
                                  f"http://127.0.0.1:{port}/v1/completions"], capture_output=True, text=True).stdout
            return parse_h2load(out)

        def _measured(pid: int, fn: Callable[[], dict[str, float]]) -> dict[str, float]:
            pids = b.tree(pid)
            t0 = b.cpu_ticks(pids)
            r = fn()
            t1 = b.cpu_ticks(pids)
            r["cpu_us"] = (t1 - t0) / hz / r["requests"] * 1e6 if r.get("requests") else float("nan")
            return r

        order = [n for n in ["direct", *names] if n in ports]
        for n in order:  # warm-up: connections to the backends, JIT-free but caches and pools filled
            for proto, (port, _) in ports[n].items():
                try:
                    if proto == "h2c":
                        h2load(port, 1)
                    else:
                        wrk(("https" if proto == "tls" else "http") + f"://127.0.0.1:{port}", 4, 1)
                except Exception as exc:  # noqa: BLE001  # a target that does not speak it shows "-"
                    b.log(f"extra warm-up {n} {proto}: {exc!s:.200}")
        res: dict[str, dict[str, list[dict[str, float]]]] = {}

        def keep(n: str, row: str, r: dict[str, float], rep: int) -> None:
            r["rep"] = rep
            res.setdefault(n, {}).setdefault(row, []).append(r)
            b.log(f"extra rep{rep} {n} {row}: " + ", ".join(f"{k}={v:.1f}" for k, v in r.items()
                                                           if k in ("requests", "p50_us", "p99_us", "cpu_us")))

        # Every target's process groups (its plain and TLS listeners), so that all but the measured one can
        # be paused: an idle proxy's telemetry poller and health checks run on the measured one's core.
        groups = {n: sorted({pid for _port, pid in ports[n].values()}) for n in order if n != "direct"}
        paused: list[int] = []

        def pause_all_but(n: str | None) -> None:
            while paused:
                try:
                    os.killpg(paused.pop(), signal.SIGCONT)
                except ProcessLookupError:
                    pass
            if n is None or not pause_idle:
                return
            for other, pids in groups.items():
                if other != n:
                    for pid in pids:
                        try:
                            os.killpg(pid, signal.SIGSTOP)
                            paused.append(pid)
                        except ProcessLookupError:
                            pass
            time.sleep(0.2)  # a step that was running when stopped is not charged to the measured one

        def measured(pid: int, fn: Callable[[], dict[str, float]], target: str | None = None) -> dict[str, float]:
            pause_all_but(target)
            try:
                return _measured(pid, fn)
            finally:
                pause_all_but(None)

        for rep in range(reps):
            seq = order if rep % 2 == 0 else order[::-1]
            if "c1" in rows:
                for n in seq:
                    port, pid = ports[n]["h1"]
                    keep(n, "h1_c1", measured(pid, lambda: c1_latencies(port, c1_secs), n), rep)
            if "cpu" in rows:
                for n in seq:
                    if n != "direct":
                        port, pid = ports[n]["h1"]
                        keep(n, "h1_cpu", measured(pid, lambda: wrk(f"http://127.0.0.1:{port}", 64, load_secs), n), rep)
            for n in seq if "h2c" in rows else []:
                if "h2c" in ports[n]:
                    port, pid = ports[n]["h2c"]
                    try:
                        r = measured(pid, lambda: h2load(port, load_secs), n)
                    except RuntimeError as exc:
                        b.log(f"extra rep{rep} {n} h2c: {exc!s:.300}")
                        continue
                    if r["requests"] > 0:
                        keep(n, "h2c_cpu", r, rep)
            for n in seq if "tls" in rows else []:
                if "tls" in ports[n]:
                    port, pid = ports[n]["tls"]
                    url = f"https://127.0.0.1:{port}"
                    try:
                        keep(n, "tls_cpu", measured(pid, lambda: wrk(url, 64, load_secs), n), rep)
                        keep(n, "tls_c1", measured(pid, lambda: c1_latencies(port, max(2, c1_secs // 2), tls=True), n),
                             rep)
                    except (RuntimeError, OSError) as exc:
                        b.log(f"extra rep{rep} {n} tls: {exc!s:.300}")
        return {"reps": reps, "c1_secs": c1_secs, "load_secs": load_secs, "targets": order, "results": res}
    finally:
        stop_groups(procs)


def extra_table(raw: dict[str, Any]) -> str:
    """Medians over repetitions; 'added' paired with direct's figure of the same repetition."""
    res = raw["results"]
    names = [n for n in raw["targets"] if n != "direct"]
    direct = {r["rep"]: r for r in res.get("direct", {}).get("h1_c1", [])}

    def med(xs: list[float]) -> float | None:
        xs = [x for x in xs if x is not None and x == x]
        return statistics.median(xs) if xs else None

    def cell(n: str, row: str, key: str, added: bool = False) -> float | None:
        rs = res.get(n, {}).get(row, [])
        if not added:
            return med([r.get(key) for r in rs])
        return med([r[key] - direct[r["rep"]][key] for r in rs if r["rep"] in direct and key in r])

    spec = [
        ("p50 at 1 connection, HTTP/1.1 (µs)", "h1_c1", "p50_us", False, "%.0f"),
        ("p99 at 1 connection, HTTP/1.1 (µs)", "h1_c1", "p99_us", False, "%.0f"),
        ("added p50 at 1 connection (µs, minus direct's)", "h1_c1", "p50_us", True, "%.0f"),
        ("added p99 at 1 connection (µs, minus direct's)", "h1_c1", "p99_us", True, "%.0f"),
        ("p99.9 at 1 connection, HTTP/1.1 (µs)", "h1_c1", "p999_us", False, "%.0f"),
        ("requests per 1-connection run", "h1_c1", "requests", False, "%.0f"),
        ("CPU µs per small POST, HTTP/1.1, 64 connections", "h1_cpu", "cpu_us", False, "%.1f"),
        ("CPU µs per small POST, h2c, 16 conns x 4 streams", "h2c_cpu", "cpu_us", False, "%.1f"),
        ("CPU µs per small POST, TLS (HTTP/1.1), 64 connections", "tls_cpu", "cpu_us", False, "%.1f"),
        ("added p50 at 1 connection over TLS (µs, minus direct's plain)", "tls_c1", "p50_us", True, "%.0f"),
        ("added p99 at 1 connection over TLS (µs, minus direct's plain)", "tls_c1", "p99_us", True, "%.0f"),
    ]
    lines = ["| per proxy core | direct | " + " | ".join(names) + " |", "|---|" + "---|" * (len(names) + 1)]
    for title, row, key, added, fmt in spec:
        d = "" if added or row != "h1_c1" else (lambda v: "-" if v is None else fmt % v)(cell("direct", row, key))
        cells = [(lambda v: "-" if v is None else fmt % v)(cell(n, row, key, added)) for n in names]
        lines.append(f"| {title} | {d} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_arm(spec: str) -> tuple[str, str, dict[str, str]]:
    """`NAME=TREE[,KEY=VALUE...]`: an affinity-proxy source tree run as one arm of `ab_c1`, with extra
    environment variables (e.g. `this-gc700=.,AFFINITY_PROXY_GC=700`); TREE `.` is this checkout."""
    name, _, rest = spec.partition("=")
    tree, *envs = rest.split(",")
    if not name or not tree or any("=" not in e for e in envs):
        raise SystemExit(f"--arm {spec!r}: expected NAME=TREE[,KEY=VALUE...]")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return name, here if tree == "." else os.path.abspath(tree), dict(e.split("=", 1) for e in envs)


def ab_c1(peers_dir: str, ap_bin: str, arms: list[tuple[str, str, dict[str, str]]], policy: str, rounds: int,
          secs: float, base_port: int, nice: int = 0) -> dict[str, Any]:
    """Latency at one connection, arm against arm in one run: every arm (an affinity-proxy tree, with its
    own environment) is up at once, pinned to core 0, backends and this client on core 1; each round
    measures direct, then every arm in a rotating order, `secs` of `c1_latencies` each (every request a
    sample). An arm not being measured is SIGSTOPped, so that its telemetry poller and health checks do not
    run on the measured arm's core (they would be part of every other arm's tail); it is resumed a second
    before its turn and warmed up for half a second. Per round and arm: p50, p99, p99.9, CPU µs per
    request of the process tree. The first arm is the reference: the report gives, per other arm, the
    median of the per-round ratios and in how many rounds the arm was lower. `nice` (e.g. -10, as root):
    every process of the run, this client included, at that niceness, so that on a machine shared with
    other work a woken proxy is scheduled ahead of it and the tail measured is the proxies' own."""

    hz, py, _venv, fake_py, run_dir, b = run_env(peers_dir, ap_bin, f"abc1-{base_port}")
    procs: list[subprocess.Popen[bytes]] = []
    logf = open(os.path.join(run_dir, "abc1.log"), "a")

    def start(cmd: list[str], cpus: str, env: dict[str, str] | None = None) -> int:
        p = subprocess.Popen(["nice", "-n", str(nice), "taskset", "-c", cpus, *cmd], stdout=logf, stderr=logf,
                             env=env, start_new_session=True, cwd=run_dir)
        procs.append(p)
        return p.pid

    if nice:
        os.nice(nice)
    backends = [base_port + 1, base_port + 2]
    ports: dict[str, int] = {}
    pids: dict[str, int] = {}
    os.sched_setaffinity(0, {1})
    res: dict[str, list[dict[str, float]]] = {"direct": []}
    try:
        for port in backends:
            start([fake_py, os.path.join(peers_dir, "fake_backend.py"), "--port", str(port), "--chunks", "16",
                   "--model-path", b.TOKDIR], "1")
        for i, (name, tree, env) in enumerate(arms):
            port = ports[name] = base_port + 10 + 10 * i
            cfg = write_ap_config(os.path.join(run_dir, f"{name}.yaml"), port, port + 1,
                                  [f"http://127.0.0.1:{p}" for p in backends], policy)
            pids[name] = start([py, "-P", "-m", "proxy", "run", "--config", cfg, "--workers", "1"], "0",
                               dict(os.environ, PYTHONPATH=tree, **env))
            res[name] = []
        time.sleep(8)
        for name in ports:
            c1_latencies(ports[name], 1.0)  # warm-up: backend connections, caches
            os.killpg(pids[name], signal.SIGSTOP)
        names = list(ports)
        for rnd in range(rounds):
            r = c1_latencies(backends[0], secs)
            r["round"] = rnd
            res["direct"].append(r)
            for k in range(len(names)):
                name = names[(rnd + k) % len(names)]
                os.killpg(pids[name], signal.SIGCONT)
                time.sleep(1.0)
                c1_latencies(ports[name], 0.5)
                tree_pids = b.tree(pids[name])
                t0 = b.cpu_ticks(tree_pids)
                r = c1_latencies(ports[name], secs)
                r["cpu_us"] = (b.cpu_ticks(tree_pids) - t0) / hz / r["requests"] * 1e6
                r["round"] = rnd
                os.killpg(pids[name], signal.SIGSTOP)
                res[name].append(r)
                b.log(f"abc1 {policy} round {rnd} {name}: p50 {r['p50_us']:.0f} p99 {r['p99_us']:.0f} "
                      f"p99.9 {r['p999_us']:.0f} µs, {r['requests']:.0f} requests, {r['cpu_us']:.1f} µs CPU/req "
                      f"(direct p50 {res['direct'][-1]['p50_us']:.0f} p99 {res['direct'][-1]['p99_us']:.0f})")
        return {"policy": policy, "rounds": rounds, "secs": secs, "nice": nice, "arms": [[n, t, e] for n, t, e in arms],
                "results": res}
    finally:
        stop_groups(procs, paused=True)


def ab_c1_table(raw: dict[str, Any]) -> str:
    """The medians per arm, and per arm against the first: median of per-round ratios, rounds lower."""
    res = raw["results"]
    names = [a[0] for a in raw["arms"]]
    ref = names[0]
    direct = {r["round"]: r for r in res["direct"]}
    keys = (("p50_us", "p50"), ("p99_us", "p99"), ("p999_us", "p99.9"), ("cpu_us", "CPU/req"))
    lines = [f"{raw['policy']}, {raw['rounds']} rounds × {raw['secs']:g} s per arm, one connection (µs)"
             + (f", niceness {raw['nice']}" if raw.get("nice") else ""), "",
             "| arm | " + " | ".join(f"{t} (median)" for _, t in keys) + " | added p50 | added p99 |",
             "|---|" + "---|" * (len(keys) + 2)]
    for n in ["direct", *names]:
        rs = res[n]
        cells = [("%.0f" if k != "cpu_us" else "%.1f") % statistics.median(r[k] for r in rs) if all(k in r for r in rs)
                 else "-" for k, _ in keys]
        added = ["-", "-"] if n == "direct" else [
            "%.0f" % statistics.median(r[k] - direct[r["round"]][k] for r in rs) for k in ("p50_us", "p99_us")]
        lines.append(f"| {n} | " + " | ".join(cells) + " | " + " | ".join(added) + " |")
    lines += ["", f"| against {ref}: median of per-round ratios (rounds lower / rounds) | "
              + " | ".join(t for _, t in keys) + " | added p99 |", "|---|" + "---|" * (len(keys) + 1)]
    by_round = {n: {r["round"]: r for r in res[n]} for n in names}
    for n in names[1:]:
        common = sorted(set(by_round[n]) & set(by_round[ref]))
        cells = []
        for k, _ in [*keys, ("added_p99", "")]:
            if k == "added_p99":
                pairs = [(by_round[n][i]["p99_us"] - direct[i]["p99_us"]) / (by_round[ref][i]["p99_us"] - direct[i]["p99_us"])
                         for i in common if by_round[ref][i]["p99_us"] > direct[i]["p99_us"]]
            else:
                pairs = [by_round[n][i][k] / by_round[ref][i][k] for i in common]
            cells.append("%.3f× (%d/%d)" % (statistics.median(pairs), sum(x < 1 for x in pairs), len(pairs))
                         if pairs else "-")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers-dir", default=os.environ.get("PEERS_DIR", "/work/shared/peers"))
    ap.add_argument("--port-base", type=int, default=28000)
    ap.add_argument("--ap-bin", default=".venv/bin/affinity-proxy")
    ap.add_argument("--label", default="this tree")
    ap.add_argument("--baseline", help="a source tree (e.g. `git archive main proxy | tar -x -C DIR`) run "
                    "beside this one as ap-rr-base / ap-aff-base, with --ap-bin's Python")
    ap.add_argument("--alt-python", help="--extra: another interpreter with this project installed (e.g. a venv "
                    "on the distribution's python3) for the `-alt` targets (ap-rr-alt, ap-aff-nolog-alt, ...)")
    ap.add_argument("--targets", default=DEFAULT_TARGETS)
    ap.add_argument("--scenarios", default="a,c,d,t")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--duration", type=int, default=4)
    ap.add_argument("--other-max", type=float, default=1000.0,
                    help="the harness's quiet gate: %% of one core of foreign CPU tolerated (1000 = off)")
    ap.add_argument("--results", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--render", help="print the tables of a raw JSON file written by an earlier run")
    ap.add_argument("--ab", metavar="POLICY", help="only the A/B CPU comparison of this tree and --baseline")
    ap.add_argument("--ab-conns", type=int, default=64)
    ap.add_argument("--ab-reps", type=int, default=6)
    ap.add_argument("--ab-h2", metavar="POLICY", help="only the A/B CPU comparison of this tree and --baseline "
                    "over HTTP/2 (h2c; h2 over TLS with --ab-h2-tls), see ab_h2")
    ap.add_argument("--ab-h2-tls", action="store_true")
    ap.add_argument("--ab-h2-conns", type=int, default=16)
    ap.add_argument("--ab-h2-streams", type=int, default=4)
    ap.add_argument("--extra", action="store_true", help="only the rows the main run lacks: p99 at one "
                    "connection from long runs, h2c and TLS (see extra_rows)")
    ap.add_argument("--extra-targets", default="nginx,vllm-rr,sglang-rr,ap-rr,ap-aff")
    ap.add_argument("--c1-secs", type=int, default=10, help="--extra: seconds of each 1-connection run")
    ap.add_argument("--extra-rows", default="c1,cpu,h2c,tls", help="--extra: which rows (c1,cpu,h2c,tls)")
    ap.add_argument("--extra-pause-idle", action="store_true",
                    help="--extra: SIGSTOP every target but the one measured (their pollers and health checks "
                         "share its core), SIGCONT after")
    ap.add_argument("--ab-c1", metavar="POLICY", help="only the A/B at one connection of the --arm trees "
                    "(default: --baseline against this tree), see ab_c1")
    ap.add_argument("--arm", action="append", default=[], help="--ab-c1: NAME=TREE[,KEY=VALUE...], repeatable; "
                    "the first is the reference")
    ap.add_argument("--ab-c1-rounds", type=int, default=8)
    ap.add_argument("--ab-c1-secs", type=float, default=5.0)
    ap.add_argument("--ab-c1-nice", type=int, default=0, help="--ab-c1: niceness of every process of the run "
                    "(negative needs root), see ab_c1")
    a = ap.parse_args()
    if a.render and a.ab_c1:
        with open(a.render) as f:
            print(ab_c1_table(json.load(f)))
        return
    if a.ab_c1:
        arms = [parse_arm(x) for x in a.arm] or (
            [("base", os.path.abspath(a.baseline), {}), parse_arm("this=.")] if a.baseline else [])
        if len(arms) < 2:
            raise SystemExit("--ab-c1 needs two --arm or a --baseline")
        raw = ab_c1(a.peers_dir, a.ap_bin, arms, a.ab_c1, a.ab_c1_rounds, a.ab_c1_secs, a.port_base + 800,
                     a.ab_c1_nice)
        out = os.path.join(a.results, "peers-abc1-raw-%s.json" % time.strftime("%Y%m%d-%H%M%S"))
        with open(out, "w") as f:
            json.dump(raw, f, indent=1)
        print(f"raw: {out}\n")
        print(ab_c1_table(raw))
        return
    if a.render and a.extra:
        with open(a.render) as f:
            print(extra_table(json.load(f)))
        return
    if a.extra:
        raw = extra_rows(a.peers_dir, a.ap_bin, a.reps, a.port_base + 700, a.c1_secs, a.duration,
                         a.extra_targets.split(","), frozenset(a.extra_rows.split(",")),
                         os.path.abspath(a.baseline) if a.baseline else None, a.extra_pause_idle,
                         a.alt_python)
        raw["pause_idle"] = a.extra_pause_idle
        raw["native"] = native_state()
        if a.alt_python:
            raw["alt_python"] = {"path": a.alt_python, "version": subprocess.run(
                [a.alt_python, "-c", "import sys; print(sys.version)"], capture_output=True, text=True).stdout.strip()}
        out = os.path.join(a.results, "peers-extra-raw-%s.json" % time.strftime("%Y%m%d-%H%M%S"))
        with open(out, "w") as f:
            json.dump(raw, f, indent=1)
        print(f"raw: {out}\n")
        print(extra_table(raw))
        return
    if a.ab_h2:
        if not a.baseline:
            raise SystemExit("--ab-h2 needs --baseline")
        ab_h2(a.peers_dir, a.baseline, a.ap_bin, a.ab_h2, a.ab_reps, a.ab_h2_conns, a.ab_h2_streams, a.ab_h2_tls,
              a.port_base + 650, a.duration)
        return
    if a.ab:
        if not a.baseline:
            raise SystemExit("--ab needs --baseline")
        ab_cpu(a.peers_dir, a.baseline, a.ap_bin, a.ab, a.ab_reps, a.ab_conns, a.port_base + 600)
        return
    if a.render:
        with open(a.render) as f:
            raw = json.load(f)
        rows = five_rows(raw)
        print(table(rows, a.label) + "\n\n" + ratios(rows))
        return
    run_dir = os.path.join(os.environ.get("PEERS_RUN", os.path.expanduser("~/.cache/peers")), f"run-{a.port_base}")
    os.makedirs(run_dir, exist_ok=True)
    b = load_harness(a.peers_dir)
    configure(b, a.port_base, os.path.abspath(a.ap_bin), run_dir, a.other_max,
              os.path.abspath(a.baseline) if a.baseline else None)
    targets = a.targets
    if a.baseline:  # each baseline target once (naming one alone used to start the other twice)
        targets += "".join(f",{t}" for t in ("ap-rr-base", "ap-aff-base") if t not in targets.split(","))
    b.RESULTS = a.results
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = os.path.join(a.results, f"peers-raw-{stamp}.json")
    # The harness's main() does the run (start, warm up, interleave, stop by PID) and writes raw-<stamp>.json.
    sys.argv = ["bench.py", "--scenarios", a.scenarios, "--reps", str(a.reps), "--duration", str(a.duration),
                "--targets", targets]
    before = set(os.listdir(a.results)) if os.path.isdir(a.results) else set()
    b.main()
    new = sorted(f for f in os.listdir(a.results) if f not in before and f.startswith("raw-") and f.endswith(".json"))
    if not new:
        raise SystemExit("the harness wrote no raw results")
    os.replace(os.path.join(a.results, new[-1]), out)
    for f in os.listdir(a.results):  # the harness's own markdown summary: the tables below replace it
        if f not in before and f.startswith("summary-"):
            os.remove(os.path.join(a.results, f))
    with open(out) as f:
        raw = json.load(f)
    raw["native"] = native_state()
    with open(out, "w") as f:
        json.dump(raw, f, indent=1)
    rows = five_rows(raw)
    print(f"raw: {out}\n")
    print(table(rows, a.label) + "\n\n" + ratios(rows))


if __name__ == "__main__":
    main()
