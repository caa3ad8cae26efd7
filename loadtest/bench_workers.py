"""Throughput of `affinity-proxy run --workers N` for N = 1 and 2, side by side in one run.

    python -m loadtest.bench_workers [--duration 5] [--connections 64] [--rounds 2] [--workers 1,2]
    python -m loadtest.bench_workers --fanout        # publishing one snapshot to a worker
    python -m loadtest.bench_workers --shared-load   # reading / updating the host-wide load block

What it measures: non-streaming OpenAI completions (a ~1 KB prompt, parsed and routed by the affinity policy,
forwarded byte for byte) through the real CLI, closed loop, `--connections` keep-alive connections.
Reported per worker count: requests/s, latency p50/p99, and the proxy's own CPU (all of its processes,
from /proc) per 1,000 requests, so that the cost is visible even where the machine is the bottleneck.

Why a fake backend: the simulator models GPU time (tens of ms per request) and costs real CPU per token;
on a 2-core machine it would be the bottleneck and hide the proxy. `FakeBackend` here answers every request
with a fixed pre-encoded JSON body from a raw asyncio protocol (no HTTP framework, no JSON encoding), so
nearly all the CPU left goes to the proxy. It still competes for the same two cores, as does this load
generator (also a raw protocol): with 2 workers the proxy cannot have two cores to itself. Read the
numbers as "what a second worker buys on a box whose cores are shared", and the CPU per request as the
proxy's cost independent of that.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import uvloop

from loadtest.run import process_cpu_seconds

# ------------------------------------------------------------------------------------------ fake backend

_RESPONSE_BODY = json.dumps(
    {
        "id": "cmpl-bench", "object": "text_completion", "created": 0, "model": "bench-model",
        "choices": [{"index": 0, "text": " ok", "finish_reason": "length", "logprobs": None}],
        "usage": {"prompt_tokens": 256, "completion_tokens": 1, "total_tokens": 257},
    }
).encode()
_RESPONSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
    + str(len(_RESPONSE_BODY)).encode()
    + b"\r\nConnection: keep-alive\r\nKeep-Alive: timeout=30\r\n\r\n"
    + _RESPONSE_BODY
)
_HEALTH = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
_METRICS = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"


class FakeBackend(asyncio.Protocol):
    """Minimal HTTP/1.1 keep-alive server: headers + Content-Length body in, a fixed answer out."""

    def __init__(self) -> None:
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end]
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            total = end + 4 + length
            if len(self.buf) < total:
                return
            self.buf = self.buf[total:]
            path = head.split(b" ", 2)[1]
            assert self.transport is not None
            if path.startswith(b"/v1/"):
                self.transport.write(_RESPONSE)
            elif path.startswith(b"/health"):
                self.transport.write(_HEALTH)
            else:
                self.transport.write(_METRICS)


async def _serve_fake(ports: list[int]) -> None:
    """Every fake backend in one process: one more process would only take more of the shared CPU."""
    loop = asyncio.get_running_loop()
    servers = [await loop.create_server(FakeBackend, "127.0.0.1", p, backlog=1024) for p in ports]
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    for server in servers:
        server.close()


# ------------------------------------------------------------------------------------------ load generator


class _Client(asyncio.Protocol):
    """One keep-alive connection sending the same request again as soon as each answer is complete."""

    def __init__(self, request: bytes, stats: _Stats) -> None:
        self.request = request
        self.stats = stats
        self.buf = b""
        self.sent_at = 0.0
        self.transport: asyncio.Transport | None = None
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._send()

    def _send(self) -> None:
        assert self.transport is not None
        if self.stats.stopping:
            self.transport.close()
            return
        self.sent_at = time.perf_counter()
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end]
            length = None
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if length is None:
                raise RuntimeError("the benchmark expects Content-Length answers: " + head.decode(errors="replace"))
            total = end + 4 + length
            if len(self.buf) < total:
                return
            self.buf = self.buf[total:]
            ok = head.startswith(b"HTTP/1.1 200")
            self.stats.record(ok, time.perf_counter() - self.sent_at)
            self._send()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


@dataclass
class _Stats:
    measuring: bool = False
    stopping: bool = False
    ok: int = 0
    errors: int = 0
    latencies: list[float] | None = None

    def record(self, ok: bool, latency: float) -> None:
        if not self.measuring:
            return
        if ok:
            self.ok += 1
            assert self.latencies is not None
            self.latencies.append(latency)
        else:
            self.errors += 1


def _request(port: int, prompt_bytes: int) -> bytes:
    words = " ".join(f"w{i}" for i in range(prompt_bytes // 5))
    body = json.dumps({"model": "bench-model", "prompt": words, "max_tokens": 1}).encode()
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


async def _load(port: int, connections: int, warmup_s: float, duration_s: float, prompt_bytes: int,
                cpu_of: Callable[[], float], fake_pid: int) -> dict[str, float]:
    loop = asyncio.get_running_loop()
    stats = _Stats(latencies=[])
    request = _request(port, prompt_bytes)
    clients = []
    for _ in range(connections):
        _, client = await loop.create_connection(lambda: _Client(request, stats), "127.0.0.1", port)
        clients.append(client)
    await asyncio.sleep(warmup_s)
    cpu0, t0 = cpu_of(), time.perf_counter()
    self0, fake0, busy0 = _self_cpu_seconds(), _tree_cpu_seconds(fake_pid), _machine_busy_seconds()
    stats.measuring = True
    await asyncio.sleep(duration_s)
    stats.measuring = False
    elapsed, cpu = time.perf_counter() - t0, cpu_of() - cpu0
    own = _self_cpu_seconds() - self0
    fake = _tree_cpu_seconds(fake_pid) - fake0
    busy = _machine_busy_seconds() - busy0
    stats.stopping = True
    await asyncio.wait([c.closed for c in clients], timeout=10)
    lat = sorted(stats.latencies or [0.0])
    done = stats.ok + stats.errors
    return {
        "rps": stats.ok / elapsed,
        "errors": float(stats.errors),
        "p50_ms": lat[len(lat) // 2] * 1000,
        "p99_ms": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000,
        "proxy_cpu_cores": cpu / elapsed,
        "proxy_cpu_ms_per_1k": (cpu / done * 1e6) if done else float("nan"),
        "loadgen_cores": own / elapsed,
        "fake_cores": fake / elapsed,
        # Everything else that ran on the machine meanwhile (other users of the shared cores).
        "other_cores": max(0.0, (busy - cpu - own - fake) / elapsed),
    }


# ------------------------------------------------------------------------------------------ processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _self_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def _machine_busy_seconds() -> float:
    """CPU seconds all cores spent not idle, from /proc/stat (user+nice+system+irq+softirq+steal)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _tree_cpu_seconds(root: int) -> float:
    """CPU seconds of `root` and its descendants (the supervisor and its workers)."""
    cpu = process_cpu_seconds([root])
    if cpu is None:
        raise RuntimeError(f"process {root} is gone")
    return cpu


async def _wait_port(port: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def _bench_one(workers: int, backend_ports: list[int], args: argparse.Namespace, fake_pid: int) -> dict[str, float]:
    port, admin = _free_port(), _free_port()
    backends = "\n".join(f"  - {{name: fake-{i}, url: 'http://127.0.0.1:{p}'}}" for i, p in enumerate(backend_ports))
    config = (
        f"listen: {{host: 127.0.0.1, port: {port}}}\nadmin: {{host: 127.0.0.1, port: {admin}}}\n"
        f"routing: {{policy: {args.policy}}}\nhealth_checks: {{enabled: false}}\nbackends:\n{backends}\n"
    )
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as fh:
        fh.write(config)
    exe = str(Path(sys.executable).with_name("affinity-proxy"))
    proc = subprocess.Popen(
        [exe, "run", "--config", fh.name, "--workers", str(workers), "--log-level", "warning"],
        stdout=subprocess.DEVNULL,
    )
    try:
        await _wait_port(port)
        await _wait_port(admin)
        # Every worker must be up before measuring (with SO_REUSEPORT a connection may land on any of them).
        await asyncio.sleep(1.0)
        return await _load(port, args.connections, args.warmup, args.duration, args.prompt_bytes,
                           lambda: _tree_cpu_seconds(proc.pid), fake_pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        os.unlink(fh.name)


async def _main(args: argparse.Namespace) -> int:
    counts = [int(w) for w in args.workers.split(",")]
    backend_ports = [_free_port() for _ in range(args.backends)]
    fakes = [
        subprocess.Popen([sys.executable, "-m", "loadtest.bench_workers", "--serve-fake",
                          ",".join(map(str, backend_ports))])
    ]
    results: dict[int, list[dict[str, float]]] = {w: [] for w in counts}
    try:
        for p in backend_ports:
            await _wait_port(p)
        for r in range(args.rounds):
            for w in counts if r % 2 == 0 else list(reversed(counts)):  # alternate the order against drift
                res = await _bench_one(w, backend_ports, args, fakes[0].pid)
                results[w].append(res)
                print(f"round {r + 1} workers={w}: {res['rps']:8.0f} req/s  p50 {res['p50_ms']:6.2f} ms  "
                      f"p99 {res['p99_ms']:6.2f} ms  proxy CPU {res['proxy_cpu_cores']:.2f} cores  "
                      f"{res['proxy_cpu_ms_per_1k']:.0f} ms/1k req  errors {res['errors']:.0f}  | load gen "
                      f"{res['loadgen_cores']:.2f}, fake backends {res['fake_cores']:.2f}, everything else "
                      f"{res['other_cores']:.2f} cores", flush=True)
    finally:
        for f in fakes:
            f.send_signal(signal.SIGTERM)
        for f in fakes:
            f.wait(timeout=10)
    print()
    print(f"cores: {os.cpu_count()}  connections: {args.connections}  prompt: ~{args.prompt_bytes} B  "
          f"policy: {args.policy}  {args.rounds} rounds x {args.duration:.0f} s (median shown)")
    print("| workers | req/s | p50 ms | p99 ms | proxy CPU (cores) | proxy CPU ms / 1k req | load gen + fake "
          "(cores) | other processes (cores) | errors | vs 1 worker |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    base = statistics.median(x["rps"] for x in results[counts[0]])
    for w in counts:
        rows = results[w]
        med = {k: statistics.median(x[k] for x in rows) for k in rows[0]}
        print(f"| {w} | {med['rps']:.0f} | {med['p50_ms']:.2f} | {med['p99_ms']:.2f} | {med['proxy_cpu_cores']:.2f} "
              f"| {med['proxy_cpu_ms_per_1k']:.0f} | {med['loadgen_cores'] + med['fake_cores']:.2f} "
              f"| {med['other_cores']:.2f} | {sum(x['errors'] for x in rows):.0f} | {med['rps'] / base:.2f}x |")
    return 0


async def _fanout(backend_counts: list[int], rounds: int = 2000) -> None:
    """What publishing one snapshot costs per worker: pickle, socketpair, unpickle (the supervisor's
    channel code), for fleets of several sizes with every telemetry field filled."""
    from proxy.core.snapshot import BackendSpec, BackendState, Health, Signals, Snapshot
    from proxy.multiproc.channel import PublishSnapshot, encode_message, read_message

    print("| backends | snapshot bytes | pickle once (us) | send + unpickle, per worker (us) | at 5 Hz: "
          "supervisor + each worker (% of a core) |")
    print("|---|---|---|---|---|")
    for n in backend_counts:
        states = tuple(
            BackendState(
                spec=BackendSpec(f"gpu-{i}", f"http://10.0.{i // 256}.{i % 256}:8000", grpc_address=f"10.0.0.{i % 256}:9000"),
                health=Health.HEALTHY, load_score=0.4, stale=False,
                signals=Signals(scraped_at=time.monotonic(), engine="vllm", mem_used_bytes=6e10, mem_total_bytes=8e10,
                                kernel_queue=12.0, running=8.0, waiting=4.0, kv_usage=0.6, kv_tokens_per_s=300.0,
                                kv_capacity_tokens=5e5, latency_ms=120.0),
            )
            for i in range(n)
        )
        snapshot = Snapshot(version=1, backends=states)
        left, right = socket.socketpair()
        _, writer = await asyncio.open_unix_connection(sock=left)
        reader, other = await asyncio.open_unix_connection(sock=right)
        t0 = time.perf_counter()
        for _ in range(rounds):
            frame = encode_message(PublishSnapshot(snapshot))
        encode = (time.perf_counter() - t0) / rounds
        t0 = time.perf_counter()
        for _ in range(rounds):
            writer.write(frame)
            await writer.drain()
            await read_message(reader)
        per = (time.perf_counter() - t0) / rounds
        print(f"| {n} | {len(frame)} | {encode * 1e6:.0f} | {per * 1e6:.0f} | "
              f"{encode * 5 * 100:.2f} + {per * 5 * 100:.2f} |")
        writer.close()
        other.close()


def _shared_load(rows_list: list[int], number: int = 200_000) -> None:
    """What reading and updating the host-wide load block costs next to the single-process table: the
    reads a policy makes per candidate backend, an acquire + release pair (the data plane's per request),
    and a whole affinity pick on 4 backends with the cost check on. Best of 5 timeit repeats."""
    import timeit

    from proxy.core.affinity import AffinityPolicy
    from proxy.core.inflight import InflightTable
    from proxy.core.request import RequestSummary
    from proxy.core.snapshot import BackendSpec, Snapshot
    from proxy.core.work_ledger import WorkLedger
    from proxy.multiproc.shared_load import SharedLoad, SlotMap

    def best(stmt: Callable[[], object], n: int = number) -> float:
        return min(timeit.repeat(stmt, number=n, repeat=5)) / n * 1e6

    snap = Snapshot.initial([BackendSpec(f"gpu-{i}", f"http://127.0.0.1:{8000 + i}") for i in range(4)])
    req = RequestSummary(prompt="a prompt of a few hundred words " * 40)
    tables: list[tuple[str, InflightTable]] = [("one process (InflightTable)", InflightTable())]
    for rows in rows_list:
        load = SharedLoad.create(workers=rows, slots=64)
        slots = SlotMap(load)
        slots.follow(snap.names)
        t = load.table(0)
        t.assign(slots.slots)
        tables.append((f"shared, {rows} workers", t))
    print("| table | get(b).requests (us) | .tokens (us) | ledger pending (us) | total_requests (us) "
          "| acquire + release (us) | affinity pick, 4 backends (us) |")
    print("|---|---|---|---|---|---|---|")
    for label, table in tables:
        for name in snap.names:
            table.acquire(name, 500)  # something in flight everywhere, as under load
        ledger = WorkLedger()
        ledger.record("gpu-1", 300.0, table)
        entry = table["gpu-1"]
        policy = AffinityPolicy()
        get = table.get

        def pick() -> None:
            d = policy.pick(req, snap, table)
            table.acquire(d.backend, 500)
            table.release(d.backend, 500)

        print(f"| {label} | {best(lambda: get('gpu-1').requests):.3f} | {best(lambda: entry.tokens):.3f} "
              f"| {best(lambda: ledger.pending('gpu-1', entry)):.3f} | {best(lambda: table.total_requests):.3f} "
              f"| {best(lambda: (table.acquire('gpu-1', 500), table.release('gpu-1', 500))):.3f} "
              f"| {best(pick, number // 20):.2f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_workers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="1,2", help="comma-separated worker counts (default 1,2)")
    parser.add_argument("--duration", type=float, default=5.0, help="measured seconds per run (default 5)")
    parser.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds first (default 1)")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="runs per worker count, order alternated")
    parser.add_argument("--backends", type=int, default=4, help="fake backends, all in one process (default 4)")
    parser.add_argument("--prompt-bytes", type=int, default=1024)
    parser.add_argument("--policy", default="affinity")
    parser.add_argument("--fanout", action="store_true",
                        help="instead: the cost of publishing one snapshot to one worker, for 4/64/256 backends")
    parser.add_argument("--shared-load", action="store_true",
                        help="instead: the cost of reading and updating the host-wide load block (timeit)")
    parser.add_argument("--serve-fake", metavar="PORT,...", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.shared_load:
        _shared_load([2, 4, 16])
        return 0
    if args.fanout:
        uvloop.run(_fanout([4, 64, 256]))
        return 0
    if args.serve_fake is not None:
        uvloop.run(_serve_fake([int(p) for p in args.serve_fake.split(",")]))
        return 0
    return uvloop.run(_main(args))


if __name__ == "__main__":
    sys.exit(main())
