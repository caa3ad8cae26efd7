"""gRPC data-plane benchmark: the same grpcio client direct to a backend and through affinity-proxy.

    python -m loadtest.bench_grpc                      # unary at concurrency 32, streaming, unary at concurrency 1
    python -m loadtest.bench_grpc --duration 3 --rounds 1
    python -m loadtest.bench_grpc --baseline before=/work/wt/before   # A/B: another source tree beside this one
    python -m loadtest.bench_grpc --profile /tmp/proxy.prof   # cProfile the proxy process

Everything runs on this machine, so absolute numbers depend on what else it is doing; the figures that
mean something are the ratios, which is why the targets (direct, this tree's proxy, and each `--baseline`
tree's proxy) take turns within one run: every round runs each kind of phase once per target, in an order
rotated from round to round, and the summary gives the median over rounds of each figure and of each
round's own ratio (a round whose phase met a busy neighbour shows up in the per-round lists).

The backend is a deliberately cheap grpclib server (an immediate fixed answer; streams of small messages as
fast as flow control allows), so what is measured is the proxy's overhead, not a simulated GPU. Each proxy
runs as its own process (``python -m proxy run``, one worker, round_robin, the default observability: access
log and heat-map windows on, tracing off), the backend in another, the client (grpcio, as most users run it)
in this one. As in bench_proxy, the proxies are pinned to core 0 and the backend and client to core 1
(``--no-pin`` lets them share both cores); only one proxy carries load at a time. The proxy's own CPU time per
call / per streamed message is read from /proc over each of its phases: that figure does not depend on what
the neighbours were doing as much as throughput does.

Phases:
- unary: `--concurrency` concurrent unary calls for `--duration` s: calls/s and proxy CPU µs per call;
- stream: `--streams` concurrent server streams of `--per-stream` messages: messages/s and CPU µs per message;
- latency: one call at a time for `--duration` s: p50/p99 of the call time; "added" is the proxied figure
  minus direct's in the same round.

A `--baseline LABEL=DIR` tree runs with ``DIR/.venv/bin/python`` when it has one (else this Python), as
``python -P -m proxy`` with ``PYTHONPATH=DIR``, so its own `proxy` package is the one imported.
Targets (issue 7): unary >= 0.6x direct, streamed messages >= 0.8x direct.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Coroutine

ROOT = Path(__file__).resolve().parent.parent
GENERATE = "/affinity.v1.Generation/Generate"
STREAM = "/affinity.v1.Generation/GenerateStream"
KINDS = ("unary", "stream", "latency")


# ------------------------------------------------------------------------------------------- backend

async def _serve_backend(port: int) -> None:
    from grpclib.server import Server

    from proxy.protos import generate_pb2 as gen
    from proxy.protos.generate_grpc import GenerationBase

    answer = gen.GenerateResponse(text="ok", finished=True, backend="bench")
    chunk = gen.GenerateResponse(text="token ", backend="bench")

    class Cheap(GenerationBase):
        async def Generate(self, stream) -> None:  # type: ignore[no-untyped-def]
            await stream.recv_message()
            await stream.send_message(answer)

        async def GenerateStream(self, stream) -> None:  # type: ignore[no-untyped-def]
            req = await stream.recv_message()
            for _ in range(req.max_tokens):
                await stream.send_message(chunk)

        async def GenerateBidi(self, stream) -> None:  # type: ignore[no-untyped-def]
            async for _ in stream:
                await stream.send_message(answer)

    server = Server([Cheap()])
    await server.start("127.0.0.1", port)
    print(json.dumps({"port": server._server.sockets[0].getsockname()[1]}), flush=True)  # noqa: SLF001
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    await stop.wait()
    server.close()
    await server.wait_closed()


# -------------------------------------------------------------------------------------------- client

@dataclass
class Result:
    ops: int
    seconds: float
    latencies_us: list[float] = field(default_factory=list)  # per call, latency phase only

    @property
    def rate(self) -> float:
        return self.ops / self.seconds if self.seconds else 0.0


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of `values`, nearest rank."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 1))))
    return ordered[rank - 1]


async def _unary(address: str, concurrency: int, duration: float, on_start: Callable[[], None]) -> Result:
    import grpc

    from proxy.protos import generate_pb2 as gen

    req = gen.GenerateRequest(prompt="the quick brown fox jumps over the lazy dog", max_tokens=16).SerializeToString()
    async with grpc.aio.insecure_channel(address) as ch:
        call = ch.unary_unary(GENERATE)
        for _ in range(50):  # warm-up: connections, HPACK tables, code paths
            await call(req)
        on_start()
        count = 0
        stop_at = time.perf_counter() + duration

        async def worker() -> None:
            nonlocal count
            while time.perf_counter() < stop_at:
                await call(req)
                count += 1

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return Result(count, time.perf_counter() - start)


async def _latency(address: str, duration: float, on_start: Callable[[], None]) -> Result:
    """One unary call at a time: the time of each, as the client sees it."""
    import grpc

    from proxy.protos import generate_pb2 as gen

    req = gen.GenerateRequest(prompt="the quick brown fox jumps over the lazy dog", max_tokens=16).SerializeToString()
    clock = time.perf_counter
    async with grpc.aio.insecure_channel(address) as ch:
        call = ch.unary_unary(GENERATE)
        for _ in range(50):
            await call(req)
        on_start()
        times: list[float] = []
        start = clock()
        stop_at = start + duration
        t = start
        while t < stop_at:
            await call(req)
            now = clock()
            times.append((now - t) * 1e6)
            t = now
        return Result(len(times), clock() - start, times)


async def _streaming(address: str, streams: int, duration: float, per_stream: int,
                     on_start: Callable[[], None]) -> Result:
    import grpc

    from proxy.protos import generate_pb2 as gen

    req = gen.GenerateRequest(prompt="stream", max_tokens=per_stream).SerializeToString()
    async with grpc.aio.insecure_channel(address) as ch:
        call = ch.unary_stream(STREAM)
        async for _ in call(gen.GenerateRequest(prompt="warm", max_tokens=100).SerializeToString()):
            pass
        on_start()
        count = 0
        stop_at = time.perf_counter() + duration

        async def worker() -> None:
            nonlocal count
            while time.perf_counter() < stop_at:
                async for _ in call(req):
                    count += 1

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(streams)))
        return Result(count, time.perf_counter() - start)


# ----------------------------------------------------------------------------------------- processes

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the proxy exited with status {proc.returncode} before listening")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listening on port {port}")


PROXY_CORE, LOAD_CORE = 0, 1


def _pin(pid: int, core: int | None) -> None:
    if core is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(pid, {core})


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process from /proc (0 where /proc is missing)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _start_backend() -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen([sys.executable, "-m", "loadtest.bench_grpc", "_backend"], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    return proc, int(json.loads(line)["port"])


@dataclass
class Proxy:
    label: str
    proc: subprocess.Popen[bytes]
    port: int
    config: str


def _start_proxy(label: str, tree: Path, backend_port: int, profile: str | None) -> Proxy:
    grpc_port, http_port, admin_port = _free_port(), _free_port(), _free_port()
    cfg = (
        f"listen: {{host: 127.0.0.1, port: {http_port}}}\n"
        f"grpc_listen: {{host: 127.0.0.1, port: {grpc_port}}}\n"
        f"admin: {{host: 127.0.0.1, port: {admin_port}}}\n"
        "telemetry: {enabled: false}\nhealth_checks: {enabled: false}\n"
        "routing: {policy: round_robin}\n"
        "backends:\n"
        f"  - {{name: bench, url: 'http://127.0.0.1:9', grpc: '127.0.0.1:{backend_port}'}}\n"
    )
    fd, path = tempfile.mkstemp(prefix=f"bench-grpc-{label}-", suffix=".yaml")
    with os.fdopen(fd, "w") as f:
        f.write(cfg)
    python = tree / ".venv" / "bin" / "python"
    cmd = [str(python) if python.exists() else sys.executable, "-P"]
    if profile:
        cmd += ["-m", "cProfile", "-o", profile]
    # The access log goes to /dev/null: its writes are measured, a terminal's speed is not.
    cmd += ["-m", "proxy", "run", "-c", path, "--workers", "1", "--log-level", "warning"]
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL)
    _wait_port(grpc_port, proc)
    return Proxy(label, proc, grpc_port, path)


def _stop(proc: subprocess.Popen, sig: int = signal.SIGINT) -> None:  # type: ignore[type-arg]
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ------------------------------------------------------------------------------------------- summary

def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarise(rounds: list[dict[str, dict[str, dict[str, float]]]], labels: list[str]) -> dict[str, object]:
    """Medians over rounds. `rounds[r][kind][target]` holds that phase's figures: `rate`, and for proxies
    `cpu_us` (per call / message); latency phases `p50_us` and `p99_us`."""
    out: dict[str, object] = {}
    for kind in KINDS:
        per_target: dict[str, dict[str, object]] = {}
        for target in ["direct", *labels]:
            got = [r[kind][target] for r in rounds if target in r.get(kind, {})]
            if not got:
                continue
            entry: dict[str, object] = {"rate": round(_median([g["rate"] for g in got]) or 0.0, 1)}
            # (target, direct) of the rounds that measured both
            pairs = [(r[kind][target], r[kind]["direct"]) for r in rounds
                     if target in r.get(kind, {}) and "direct" in r[kind]] if target != "direct" else []
            if pairs:
                ratios = [g["rate"] / d["rate"] for g, d in pairs if d["rate"]]
                entry["rate_vs_direct"] = round(_median(ratios) or 0.0, 3)
                entry["rate_vs_direct_per_round"] = [round(x, 3) for x in ratios]
            if target != "direct":
                cpus = [g["cpu_us"] for g in got if "cpu_us" in g]
                entry["cpu_us"] = round(_median(cpus) or 0.0, 2)
                entry["cpu_us_per_round"] = [round(x, 2) for x in cpus]
            if kind == "latency":
                entry["p50_us"] = round(_median([g["p50_us"] for g in got]) or 0.0, 1)
                entry["p99_us"] = round(_median([g["p99_us"] for g in got]) or 0.0, 1)
                if pairs:
                    entry["added_p50_us"] = round(_median([g["p50_us"] - d["p50_us"] for g, d in pairs]) or 0.0, 1)
                    entry["added_p99_us"] = round(_median([g["p99_us"] - d["p99_us"] for g, d in pairs]) or 0.0, 1)
            per_target[target] = entry
        if per_target:
            out[kind] = per_target
    # This tree against each baseline: the median of the per-round CPU ratios (same round, same neighbours).
    if len(labels) > 1:
        this = labels[0]
        versus: dict[str, dict[str, float]] = {}
        for other in labels[1:]:
            row: dict[str, float] = {}
            for kind in KINDS:
                pairs = [(r[kind][this], r[kind][other]) for r in rounds
                         if this in r.get(kind, {}) and other in r.get(kind, {})]
                cpu = [a["cpu_us"] / b["cpu_us"] for a, b in pairs if b.get("cpu_us")]
                rate = [a["rate"] / b["rate"] for a, b in pairs if b["rate"]]
                if cpu:
                    row[f"{kind}_cpu_ratio"] = round(statistics.median(cpu), 3)
                if rate:
                    row[f"{kind}_rate_ratio"] = round(statistics.median(rate), 3)
            versus[other] = row
        out[f"{this}_vs"] = versus
    return out


def markdown(summary: dict[str, object], labels: list[str]) -> str:
    """The summary as a table: one column per target."""
    cols = ["direct", *labels]
    rows: list[tuple[str, str, str]] = [
        ("unary", "rate", "unary calls/s (concurrency {c})"),
        ("unary", "rate_vs_direct", "  vs direct"),
        ("unary", "cpu_us", "proxy CPU µs per unary call"),
        ("stream", "rate", "streamed messages/s ({s} streams)"),
        ("stream", "rate_vs_direct", "  vs direct"),
        ("stream", "cpu_us", "proxy CPU µs per streamed message"),
        ("latency", "p50_us", "p50 µs, one call at a time"),
        ("latency", "p99_us", "p99 µs, one call at a time"),
        ("latency", "added_p50_us", "added p50 µs"),
        ("latency", "added_p99_us", "added p99 µs"),
        ("latency", "cpu_us", "proxy CPU µs per call, one at a time"),
    ]
    lines = ["| | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for kind, key, title in rows:
        data = summary.get(kind)
        if not isinstance(data, dict):
            continue
        cells = []
        for c in cols:
            v = data.get(c, {}).get(key)
            cells.append("" if v is None else (f"{v:,.0f}" if key == "rate" else f"{v:g}"))
        if any(cells):
            lines.append(f"| {title} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------- in-process relay cost

class _Wire:
    """An in-memory transport: what the proxy writes is kept for the other end to read."""

    def __init__(self, peer: tuple[str, int]) -> None:
        self.out = bytearray()
        self._peer = peer

    def write(self, data: bytes) -> None:
        self.out += data

    def take(self) -> bytes:
        data, self.out = bytes(self.out), bytearray()
        return data

    def get_extra_info(self, name: str, default: object = None) -> object:
        return self._peer if name == "peername" else default

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass


async def _relay_cost(calls: int, batches: int, messages: int) -> dict[str, float]:
    """The proxy's own CPU per unary call and per streamed message, without sockets or other processes.

    The real listener (`AffinityProxy` with the benchmark's config) relays between an h2 client and an h2
    backend that live in this process behind in-memory transports; only the proxy's callbacks (its
    connections' `data_received` and the write flusher) are timed, on this thread's CPU clock, so time
    the scheduler gives to other processes is not counted. Per batch of `calls` calls (or streamed
    messages); the minimum over `batches` is the figure that neighbours inflate least.
    """
    import h2.config
    import h2.connection
    import h2.events

    from proxy.app import AffinityProxy
    from proxy.config import parse_config
    from proxy.grpc.downstream import Downstream
    from proxy.grpc.upstream import Upstream
    from proxy.protos import generate_pb2 as gen

    backend_address = f"127.0.0.1:{_free_port()}"  # never connected to: the backend is in-process
    cfg = ("listen: {host: 127.0.0.1, port: 0}\ngrpc_listen: {host: 127.0.0.1, port: 0}\n"
           "admin: {host: 127.0.0.1, port: 0}\ntelemetry: {enabled: false}\nhealth_checks: {enabled: false}\n"
           "routing: {policy: round_robin}\nbackends:\n"
           f"  - {{name: bench, url: 'http://127.0.0.1:9', grpc: '{backend_address}'}}\n")
    proxy = AffinityProxy(parse_config(cfg))
    await proxy.start()
    try:
        assert proxy.grpc is not None and proxy.grpc.ctx is not None
        ctx = proxy.grpc.ctx
        flusher = ctx.flusher
        clock = time.thread_time_ns
        spent = [0]

        def timed(fn: Callable[[bytes], None], data: bytes) -> None:
            t0 = clock()
            fn(data)
            flusher.run()
            spent[0] += clock() - t0

        client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
        backend = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
        client.initiate_connection()
        backend.initiate_connection()
        down_wire, up_wire = _Wire(("127.0.0.1", 50000)), _Wire(("127.0.0.1", 1))
        down = Downstream(ctx)
        down.connection_made(down_wire)  # type: ignore[arg-type]  # an in-memory transport
        pool = ctx.pools.get("bench", backend_address)
        pool.connecting += 1  # as `BackendPool._connect` counts it until the backend's SETTINGS
        up = Upstream(pool)
        up.connection_made(up_wire)  # type: ignore[arg-type]

        def pump() -> None:
            """Move bytes between the four ends until nobody has anything to say."""
            while True:
                flusher.run()
                moved = False
                data = client.data_to_send()
                if data:
                    timed(down.data_received, data)
                    moved = True
                data = down_wire.take()
                if data:
                    for ev in client.receive_data(data):
                        if isinstance(ev, h2.events.DataReceived):
                            client.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                            received["bytes"] += len(ev.data)
                        elif isinstance(ev, h2.events.TrailersReceived):
                            if (b"grpc-status", b"0") not in [tuple(h) for h in ev.headers]:
                                raise RuntimeError(f"a relayed call failed: {ev.headers}")
                            received["ok"] += 1
                        elif isinstance(ev, h2.events.StreamReset):
                            raise RuntimeError(f"a relayed call was reset: {ev}")
                    moved = True
                data = up_wire.take()
                if data:
                    for ev in backend.receive_data(data):
                        if isinstance(ev, h2.events.DataReceived):
                            backend.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                            if ev.stream_ended is not None:
                                answer(ev.stream_id)
                        elif isinstance(ev, h2.events.StreamEnded) and ev.stream_id in pending:
                            answer(ev.stream_id)
                    moved = True
                data = backend.data_to_send()
                if data:
                    timed(up.data_received, data)
                    moved = True
                if not moved:
                    return

        request = gen.GenerateRequest(prompt="the quick brown fox jumps over the lazy dog", max_tokens=16)
        body = request.SerializeToString()
        message = b"\x00" + len(body).to_bytes(4, "big") + body
        reply = gen.GenerateResponse(text="ok", finished=True, backend="bench").SerializeToString()
        reply_msg = b"\x00" + len(reply).to_bytes(4, "big") + reply
        chunk = gen.GenerateResponse(text="token ", backend="bench").SerializeToString()
        chunk_msg = b"\x00" + len(chunk).to_bytes(4, "big") + chunk
        headers = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", GENERATE.encode()),
                   (b":authority", b"127.0.0.1:50000"), (b"te", b"trailers"),
                   (b"content-type", b"application/grpc"),
                   (b"user-agent", b"grpc-python-asyncio/1.66.1 grpc-c/43.0.0 (linux; chttp2)"),
                   (b"grpc-accept-encoding", b"identity, deflate, gzip")]
        pending: set[int] = set()
        streamed = {"n": 0}
        received = {"ok": 0, "bytes": 0}  # what the client got: calls ended with grpc-status 0, DATA bytes

        def answer(sid: int) -> None:
            pending.discard(sid)
            backend.send_headers(sid, [(b":status", b"200"), (b"content-type", b"application/grpc+proto")])
            if streamed["n"]:
                for _ in range(streamed["n"]):
                    backend.send_data(sid, chunk_msg)
                    timed(up.data_received, backend.data_to_send())  # one message per read: the costly case
            else:
                backend.send_data(sid, reply_msg)
            backend.send_headers(sid, [(b"grpc-status", b"0")], end_stream=True)

        def one_call(n_messages: int) -> None:
            sid = client.get_next_available_stream_id()
            streamed["n"] = n_messages
            pending.add(sid)
            client.send_headers(sid, headers)
            client.send_data(sid, message, end_stream=True)
            pump()

        pump()  # prefaces and SETTINGS
        for _ in range(200):  # warm-up: HPACK tables, code paths
            one_call(0)
        per_call: list[float] = []
        for _ in range(batches):
            spent[0] = 0
            for _ in range(calls):
                one_call(0)
            per_call.append(spent[0] / calls / 1000)
            await asyncio.sleep(0)  # let the loop run what the calls scheduled
        per_msg: list[float] = []
        if messages:
            for _ in range(batches):
                spent[0] = 0
                one_call(messages)
                per_msg.append(spent[0] / messages / 1000)
                await asyncio.sleep(0)
        expected = 200 + calls * batches + (batches if messages else 0)
        want_bytes = (200 + calls * batches) * len(reply_msg) + (batches * messages * len(chunk_msg) if messages else 0)
        if received["ok"] != expected or received["bytes"] != want_bytes:
            raise RuntimeError(f"the client got {received} of {expected} calls and {want_bytes} bytes")
        out = {"unary_us_min": min(per_call), "unary_us_median": statistics.median(per_call)}
        if per_msg:
            out.update(stream_us_per_msg_min=min(per_msg), stream_us_per_msg_median=statistics.median(per_msg))
        return out
    finally:
        await proxy.stop()


def relay_ab(trees: list[tuple[str, Path]], rounds: int, calls: int, batches: int, messages: int) -> dict[str, object]:
    """`_relay_cost` for each tree in its own process, trees alternating, `rounds` times."""
    script = Path(__file__).resolve()
    got: dict[str, list[dict[str, float]]] = {label: [] for label, _ in trees}
    for r in range(rounds):
        shift = r % len(trees)
        for label, tree in trees[shift:] + trees[:shift]:
            python = tree / ".venv" / "bin" / "python"
            cmd = [str(python) if python.exists() else sys.executable, "-P", str(script), "_relay",
                   "--calls", str(calls), "--batches", str(batches), "--messages", str(messages)]
            env = dict(os.environ, PYTHONPATH=str(tree))
            res = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, timeout=600)
            if res.returncode != 0:
                raise RuntimeError(f"{label}: relay cost run failed: {res.stderr[-2000:]}")
            fig = json.loads(res.stdout.strip().splitlines()[-1])
            got[label].append(fig)
            print(f"round {r + 1} relay {label:10s} " + "  ".join(f"{k} {v:.2f}" for k, v in fig.items()), flush=True)
    summary: dict[str, object] = {label: {k: round(statistics.median(f[k] for f in figs), 2) for k in figs[0]}
                                  for label, figs in got.items()}
    this = trees[0][0]
    for other, _ in trees[1:]:
        ratios = {k: round(statistics.median(a[k] / b[k] for a, b in zip(got[this], got[other])), 3)
                  for k in got[this][0]}
        summary[f"{this}_vs_{other}"] = ratios
    summary["raw"] = got
    return summary


# ---------------------------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", nargs="?", default="bench", choices=["bench", "relay", "_backend", "_relay"],
                    help="bench: the processes above; relay: the in-process relay cost per tree (_relay)")
    ap.add_argument("--calls", type=int, default=500, help="relay: unary calls per timed batch")
    ap.add_argument("--batches", type=int, default=15, help="relay: timed batches per run")
    ap.add_argument("--messages", type=int, default=500, help="relay: messages per streamed call (0: none)")
    ap.add_argument("--duration", type=float, default=4.0, help="seconds per measured phase")
    ap.add_argument("--rounds", type=int, default=2, help="rounds; each runs every phase once per target")
    ap.add_argument("--concurrency", type=int, default=32, help="concurrent unary calls")
    ap.add_argument("--streams", type=int, default=8, help="concurrent server streams")
    ap.add_argument("--per-stream", type=int, default=2000, help="messages per stream call")
    ap.add_argument("--baseline", action="append", default=[], metavar="LABEL=DIR",
                    help="also run the proxy of another source tree (repeatable), e.g. before=/work/wt/before")
    ap.add_argument("--label", default="proxy", help="this tree's name in the output")
    ap.add_argument("--profile", default=None, help="write a cProfile of this tree's proxy process here")
    ap.add_argument("--json", default=None, help="also write the results as JSON here")
    ap.add_argument("--only", default=None, help="comma-separated phases to run: unary, stream, latency")
    ap.add_argument("--skip-direct", action="store_true",
                    help="proxies only (an A/B of CPU per call between trees; no ratios to direct)")
    ap.add_argument("--no-pin", action="store_true", help="do not pin proxies / backend+client to separate cores")
    args = ap.parse_args(argv)
    if args.mode == "_backend":
        import uvloop

        uvloop.run(_serve_backend(0))
        return 0
    if args.mode == "_relay":
        import logging

        import uvloop

        logging.basicConfig(level=logging.WARNING)
        result = uvloop.run(_relay_cost(args.calls, args.batches, args.messages))
        print(json.dumps(result), flush=True)
        return 0
    kinds = list(KINDS) if args.only is None else [k.strip() for k in args.only.split(",")]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        ap.error(f"--only: unknown phase(s) {', '.join(unknown)} (choose from {', '.join(KINDS)})")
    trees: list[tuple[str, Path]] = [(args.label, ROOT)]
    for spec in args.baseline:
        label, sep, path = spec.partition("=")
        if not sep or not label or not Path(path).is_dir():
            ap.error(f"--baseline wants LABEL=DIR with an existing DIR, got {spec!r}")
        trees.append((label, Path(path).resolve()))
    labels = [t[0] for t in trees]
    if len(set(labels)) != len(labels) or "direct" in labels:
        ap.error("labels must be distinct and not 'direct'")
    if args.mode == "relay":
        relay = relay_ab(trees, args.rounds, args.calls, args.batches, args.messages)
        print(json.dumps({k: v for k, v in relay.items() if k != "raw"}, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(relay, indent=2) + "\n")
        return 0

    # A SIGTERM (e.g. from `timeout`) must still stop the child processes in the `finally` below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    pin = not args.no_pin and (os.cpu_count() or 1) >= 2
    backend, backend_port = _start_backend()
    proxies: list[Proxy] = []
    rounds: list[dict[str, dict[str, dict[str, float]]]] = []
    try:
        for i, (label, tree) in enumerate(trees):
            proxies.append(_start_proxy(label, tree, backend_port, args.profile if i == 0 else None))
        if pin:
            for p in proxies:
                _pin(p.proc.pid, PROXY_CORE)
            _pin(backend.pid, LOAD_CORE)
            _pin(0, LOAD_CORE)  # this process: the grpcio client
        targets: list[tuple[str, str, int | None]] = [] if args.skip_direct else [
            ("direct", f"127.0.0.1:{backend_port}", None)]
        targets += [(p.label, f"127.0.0.1:{p.port}", p.proc.pid) for p in proxies]

        def phase(kind: str, address: str, on_start: Callable[[], None]) -> Coroutine[Any, Any, Result]:
            if kind == "unary":
                return _unary(address, args.concurrency, args.duration, on_start)
            if kind == "stream":
                return _streaming(address, args.streams, args.duration, args.per_stream, on_start)
            return _latency(address, args.duration, on_start)

        for r in range(args.rounds):
            rounds.append({})
            shift = r % len(targets)
            order = targets[shift:] + targets[:shift]
            for kind in kinds:
                got = rounds[-1].setdefault(kind, {})
                for name, address, pid in order:
                    cpu0 = [0.0]  # the proxy's CPU time once the warm-up calls are done

                    def measuring(pid: int | None = pid, cpu0: list[float] = cpu0) -> None:
                        if pid is not None:
                            cpu0[0] = _cpu_seconds(pid)

                    res = asyncio.run(phase(kind, address, measuring))
                    fig: dict[str, float] = {"rate": res.rate}
                    if pid is not None and res.ops:
                        fig["cpu_us"] = (_cpu_seconds(pid) - cpu0[0]) / res.ops * 1e6
                    extra = ""
                    if res.latencies_us:
                        fig["p50_us"] = percentile(res.latencies_us, 0.50)
                        fig["p99_us"] = percentile(res.latencies_us, 0.99)
                        extra = f"  p50 {fig['p50_us']:.0f} µs  p99 {fig['p99_us']:.0f} µs"
                    if "cpu_us" in fig:
                        extra += f"  cpu {fig['cpu_us']:.1f} µs/op"
                    got[name] = fig
                    print(f"round {r + 1} {kind:8s} {name:10s} {res.rate:10.0f}/s  ({res.ops} in "
                          f"{res.seconds:.1f} s){extra}", flush=True)
    finally:
        for p in proxies:
            _stop(p.proc)
            os.unlink(p.config)
        _stop(backend, signal.SIGTERM)

    summary: dict[str, object] = {
        "command": "python -m loadtest.bench_grpc " + " ".join(argv if argv is not None else sys.argv[1:]),
        "cpus": os.cpu_count(), "rounds": args.rounds, "duration_s": args.duration, "pinned": pin,
        "concurrency": args.concurrency, "streams": args.streams, "per_stream": args.per_stream,
        "trees": {label: str(tree) for label, tree in trees},
        **summarise(rounds, labels),
        "raw_rounds": rounds,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "raw_rounds"}, indent=2))
    print(markdown(summary, labels).replace("{c}", str(args.concurrency)).replace("{s}", str(args.streams)))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    if args.profile:
        print(f"proxy profile written to {args.profile} (python -m pstats {args.profile})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
