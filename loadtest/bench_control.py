"""Control-plane CPU: the telemetry poller over 8, 64 and 256 backends at 5 Hz.

    python -m loadtest.bench_control [--sizes 8,64,256] [--seconds 5] [--interval-ms 200] [--compare-full-parse]

The backends are cheap fake metrics servers in a separate process (raw asyncio protocols on uvloop that
answer every GET with the same prebuilt response: a 302-line, 30 KB vLLM exposition from
tests/fixtures/metrics plus the GPU-agent series), so their CPU is not counted. The poller runs here, in
this process, exactly as the proxy runs it (Poller + SnapshotStore + TelemetryMetrics). The figure is this
process's CPU time (user + system) divided by wall time while polling: the share of one core the control
plane costs. Target: < 5% of one core at 64 backends.

`--compare-full-parse` adds a row per size where each page is also parsed with prometheus_client's parser,
what a naive poller would do; `--compare-aiohttp` one where the scrapes go through aiohttp's client instead
of proxy/control/httpget.py: side-by-side ratios in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import resource
import socket
import time
from pathlib import Path
from typing import Any

import uvloop
from prometheus_client import CollectorRegistry

from proxy.control.adapters import MetricsReader
from proxy.control.poller import Poller
from proxy.control.store import SnapshotStore
from proxy.control.telemetry_config import TelemetryConfig
from proxy.control.telemetry_metrics import TelemetryMetrics
from proxy.core.snapshot import BackendSpec, Snapshot

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "metrics"


def _page() -> bytes:
    text = (FIXTURES / "vllm.txt").read_text() + (FIXTURES / "agent.txt").read_text()
    return text.encode()


class _MetricsProtocol(asyncio.Protocol):
    """Answers each request in the buffer with the prebuilt response; keep-alive, no parsing beyond CRLFCRLF."""

    response = b""

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end == -1:
                return
            self.buf = self.buf[end + 4:]
            self.transport.write(self.response)


def _serve(n: int, ready: Any) -> None:
    body = _page()
    _MetricsProtocol.response = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )

    async def main() -> None:
        loop = asyncio.get_running_loop()
        ports = []
        for _ in range(n):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            server = await loop.create_server(_MetricsProtocol, sock=sock, backlog=1024)
            ports.append(server.sockets[0].getsockname()[1])
        ready.send(ports)
        await asyncio.Event().wait()

    uvloop.run(main())


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def _measure(ports: list[int], seconds: float, interval_ms: int, full_parse: bool,
                   fast_http: bool = True) -> dict[str, float]:
    specs = [BackendSpec(name=f"b{i}", url=f"http://127.0.0.1:{p}") for i, p in enumerate(ports)]
    store = SnapshotStore(Snapshot.initial(specs))
    cfg = TelemetryConfig(interval_ms=interval_ms, timeout_ms=int(interval_ms * 0.75))
    poller = Poller(store, cfg, metrics=TelemetryMetrics(CollectorRegistry()))
    poller.fast_http = fast_http
    if full_parse:
        from prometheus_client.parser import text_string_to_metric_families

        plain = MetricsReader.read

        def read(self: MetricsReader, text: str) -> Any:
            for _ in text_string_to_metric_families(text):
                pass
            return plain(self, text)

        poller._extractor = type("FullParse", (MetricsReader,), {"read": read})(  # type: ignore[assignment]
            engine=cfg.engine, metric_map=())
    await poller.start()
    try:
        # warm up: connections open, first readings taken
        while poller.rounds < 5:
            await asyncio.sleep(interval_ms / 1000)
        rounds0, cpu0, t0 = poller.rounds, _cpu(), time.perf_counter()
        await asyncio.sleep(seconds)
        rounds1, cpu1, t1 = poller.rounds, _cpu(), time.perf_counter()
    finally:
        await poller.stop()
    snap = store.current
    fresh = sum(1 for b in snap.backends if not b.stale)
    wall = t1 - t0
    rounds = rounds1 - rounds0
    return {
        "backends": len(ports),
        "rounds_per_s": rounds / wall,
        "scrapes_per_s": rounds * len(ports) / wall,
        "cpu_pct_of_core": 100.0 * (cpu1 - cpu0) / wall,
        "cpu_us_per_scrape": 1e6 * (cpu1 - cpu0) / max(rounds * len(ports), 1),
        "fresh": fresh,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="8,64,256")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--interval-ms", type=int, default=200)
    ap.add_argument("--compare-full-parse", action="store_true")
    ap.add_argument("--compare-aiohttp", action="store_true", help="also scrape through aiohttp's client")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    for n in sizes:
        parent, child = multiprocessing.Pipe()
        proc = multiprocessing.Process(target=_serve, args=(n, child), daemon=True)
        proc.start()
        try:
            ports = parent.recv()
            modes = [("targeted", False, True)]
            if args.compare_aiohttp:
                modes.append(("targeted, aiohttp client", False, False))
            if args.compare_full_parse:
                modes.append(("prometheus_client+targeted", True, True))
            for label, full, fast in modes:
                row = uvloop.run(_measure(ports, args.seconds, args.interval_ms, full, fast))
                row["parser"] = label
                rows.append(row)
        finally:
            proc.terminate()
            proc.join()
    print(f"telemetry poller, {args.interval_ms} ms interval, {args.seconds:.0f} s per row, pid {os.getpid()}, "
          f"{os.cpu_count()} CPUs; page = {len(_page())} bytes")
    print(f"{'backends':>8} {'mode':<28} {'rounds/s':>8} {'scrapes/s':>9} {'CPU % core':>10} "
          f"{'CPU us/scrape':>13} {'fresh':>6}")
    for r in rows:
        print(f"{r['backends']:>8} {r['parser']:<28} {r['rounds_per_s']:>8.2f} {r['scrapes_per_s']:>9.0f} "
              f"{r['cpu_pct_of_core']:>10.2f} {r['cpu_us_per_scrape']:>13.1f} {r['fresh']:>6}")


if __name__ == "__main__":
    main()
