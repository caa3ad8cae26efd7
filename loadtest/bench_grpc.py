"""gRPC data-plane benchmark: the same grpcio client direct to a backend and through affinity-proxy.

    python -m loadtest.bench_grpc                      # ~40 s: unary at concurrency 32, then streaming
    python -m loadtest.bench_grpc --duration 3 --rounds 1
    python -m loadtest.bench_grpc --profile /tmp/proxy.prof   # cProfile the proxy process

Everything runs on this machine, so absolute numbers depend on what else it is doing; the figures that
mean something are the ratios, which is why direct and proxied phases alternate within one run: the
headline ratio is best proxied / best direct over `--rounds`, and each round's own ratio is printed too
(a round whose proxied phase met a busy neighbour shows up there). The backend is a deliberately cheap grpclib server (an immediate fixed answer;
streams of small messages as fast as flow control allows), so what is measured is the proxy's overhead,
not a simulated GPU. The proxy runs as its own process (``python -m proxy run``, one worker), the backend
in another, the client (grpcio, as most users run it) in this one. As in bench_proxy, the proxy is pinned
to core 0 and the backend and client to core 1 (``--no-pin`` lets them share both cores), and the proxy's
own CPU time per call / per streamed message is read from /proc over each proxied phase: that figure does
not depend on what the neighbours were doing.
Targets (issue 7): unary >= 0.6x direct, streamed messages >= 0.8x direct.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GENERATE = "/affinity.v1.Generation/Generate"
STREAM = "/affinity.v1.Generation/GenerateStream"


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

    @property
    def rate(self) -> float:
        return self.ops / self.seconds if self.seconds else 0.0


async def _unary(address: str, concurrency: int, duration: float) -> Result:
    import grpc

    from proxy.protos import generate_pb2 as gen

    req = gen.GenerateRequest(prompt="the quick brown fox jumps over the lazy dog", max_tokens=16).SerializeToString()
    async with grpc.aio.insecure_channel(address) as ch:
        call = ch.unary_unary(GENERATE)
        for _ in range(50):  # warm-up: connections, HPACK tables, code paths
            await call(req)
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


async def _streaming(address: str, streams: int, duration: float, per_stream: int) -> Result:
    import grpc

    from proxy.protos import generate_pb2 as gen

    req = gen.GenerateRequest(prompt="stream", max_tokens=per_stream).SerializeToString()
    async with grpc.aio.insecure_channel(address) as ch:
        call = ch.unary_stream(STREAM)
        async for _ in call(gen.GenerateRequest(prompt="warm", max_tokens=100).SerializeToString()):
            pass
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


def _wait_port(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
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


def _start_proxy(backend_port: int, profile: str | None) -> tuple[subprocess.Popen[bytes], int, str]:
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
    fd, path = tempfile.mkstemp(prefix="bench-grpc-", suffix=".yaml")
    with os.fdopen(fd, "w") as f:
        f.write(cfg)
    cmd = [sys.executable]
    if profile:
        cmd += ["-m", "cProfile", "-o", profile]
    cmd += ["-m", "proxy", "run", "-c", path, "--workers", "1", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=ROOT)
    _wait_port(grpc_port)
    return proc, grpc_port, path


def _stop(proc: subprocess.Popen, sig: int = signal.SIGINT) -> None:  # type: ignore[type-arg]
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", nargs="?", default="bench", choices=["bench", "_backend"])
    ap.add_argument("--duration", type=float, default=4.0, help="seconds per measured phase")
    ap.add_argument("--rounds", type=int, default=2, help="alternating direct/proxy rounds (best of each)")
    ap.add_argument("--concurrency", type=int, default=32, help="concurrent unary calls")
    ap.add_argument("--streams", type=int, default=8, help="concurrent server streams")
    ap.add_argument("--per-stream", type=int, default=2000, help="messages per stream call")
    ap.add_argument("--profile", default=None, help="write a cProfile of the proxy process here")
    ap.add_argument("--json", default=None, help="also write the results as JSON here")
    ap.add_argument("--only", choices=["unary", "stream"], default=None, help="run one kind of phase")
    ap.add_argument("--no-pin", action="store_true", help="do not pin proxy / backend+client to separate cores")
    args = ap.parse_args(argv)
    if args.mode == "_backend":
        import uvloop

        uvloop.run(_serve_backend(0))
        return 0

    # A SIGTERM (e.g. from `timeout`) must still stop the child processes in the `finally` below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    pin = not args.no_pin and (os.cpu_count() or 1) >= 2
    backend, backend_port = _start_backend()
    proxy, proxy_port, cfg_path = _start_proxy(backend_port, args.profile)
    if pin:
        _pin(proxy.pid, PROXY_CORE)
        _pin(backend.pid, LOAD_CORE)
        _pin(0, LOAD_CORE)  # this process: the grpcio client
    direct = f"127.0.0.1:{backend_port}"
    via = f"127.0.0.1:{proxy_port}"
    best: dict[str, float] = {}
    rounds: list[dict[str, float]] = []
    cpu_per_op: dict[str, list[float]] = {"unary": [], "stream": []}
    phases = [
        ("unary_direct", lambda: _unary(direct, args.concurrency, args.duration)),
        ("unary_proxy", lambda: _unary(via, args.concurrency, args.duration)),
        ("stream_direct", lambda: _streaming(direct, args.streams, args.duration, args.per_stream)),
        ("stream_proxy", lambda: _streaming(via, args.streams, args.duration, args.per_stream)),
    ]
    if args.only is not None:
        phases = [p for p in phases if p[0].startswith(args.only)]
    try:
        for r in range(args.rounds):
            rounds.append({})
            for name, coro_fn in phases:
                cpu0 = _cpu_seconds(proxy.pid)
                res = asyncio.run(coro_fn())
                if name.endswith("_proxy") and res.ops:
                    cpu_per_op[name.split("_")[0]].append((_cpu_seconds(proxy.pid) - cpu0) / res.ops * 1e6)
                print(f"round {r + 1} {name:14s} {res.rate:10.0f}/s  ({res.ops} in {res.seconds:.1f} s)", flush=True)
                best[name] = max(best.get(name, 0.0), res.rate)
                rounds[-1][name] = res.rate
    finally:
        _stop(proxy)
        _stop(backend, signal.SIGTERM)
        os.unlink(cfg_path)
    def per_round(kind: str) -> list[float]:
        return [round(r[f"{kind}_proxy"] / r[f"{kind}_direct"], 3) for r in rounds if f"{kind}_proxy" in r]

    summary: dict[str, object] = {"cpus": os.cpu_count(), "rounds": args.rounds, "duration_s": args.duration,
                                  "pinned": pin}
    if "unary_proxy" in best:
        summary["unary_calls_per_s"] = {
            "direct": round(best["unary_direct"]), "proxy": round(best["unary_proxy"]),
            "ratio": round(best["unary_proxy"] / best["unary_direct"], 3), "target": 0.6,
            "ratio_per_round": per_round("unary"), "concurrency": args.concurrency,
            "proxy_cpu_us_per_call": round(min(cpu_per_op["unary"]), 1) if cpu_per_op["unary"] else None}
    if "stream_proxy" in best:
        summary["stream_msgs_per_s"] = {
            "direct": round(best["stream_direct"]), "proxy": round(best["stream_proxy"]),
            "ratio": round(best["stream_proxy"] / best["stream_direct"], 3), "target": 0.8,
            "ratio_per_round": per_round("stream"), "streams": args.streams,
            "proxy_cpu_us_per_msg": round(min(cpu_per_op["stream"]), 2) if cpu_per_op["stream"] else None}
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    if args.profile:
        print(f"proxy profile written to {args.profile} (python -m pstats {args.profile})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
