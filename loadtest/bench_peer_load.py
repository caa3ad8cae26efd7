"""What routing.peer_load costs at a given refresh (issue 13, round 5): a real `redis-server` and `--rows`
processes, each running the proxy's own exchange (`proxy.control.peer_load.PeerLoadExchange`: `own_load`
over a real work ledger and shared in-flight row, `encode_row`, the one Lua round trip, `merge_rows`,
`host_view`) as `--workers` workers of `--hosts` hosts do, every backend with `--entries` live requests
and ledger entries (a full row: the most a row carries). Measured: the CPU each process and Redis spend
per second of wall time and per exchange (process CPU time: a busy machine slows the exchanges, so the
achieved rate may fall short of the refresh, but hardly changes what each one costs), and from that the
cost at the refresh's own rate.

    .venv/bin/python loadtest/bench_peer_load.py --rows 8 --hosts 4 --backends 16 --entries 64 16 --refresh-ms 10 20

Results: loadtest/results/scaleout.md, Round 5.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _redis_cpu(port: int) -> float:
    import redis

    info = redis.Redis(host="127.0.0.1", port=port).info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


async def _child(url: str, host: int, worker: int, backends: int, entries: int, refresh_ms: int,
                 warmup: float, duration: float) -> dict[str, float]:
    from prometheus_client import CollectorRegistry

    from proxy.control.peer_load import PeerLoadExchange, encode_row, own_load
    from proxy.core.inflight import SharedInflightTable, SharedLayout
    from proxy.core.routing_config import PeerLoadConfig
    from proxy.core.work_ledger import WorkLedger

    names = [f"gpu-{k}" for k in range(backends)]
    layout = SharedLayout(rows=2, slots=backends)
    table = SharedInflightTable(memoryview(bytearray(layout.size)), layout, worker % 2)
    table.assign({n: k for k, n in enumerate(names)})
    ledger = WorkLedger()
    for n in names:  # a full row: `entries` live requests and as many ledger entries per backend
        for k in range(entries):
            ledger.record(n, 100.0 + k, table)
            table.acquire(n, 1000)
    calls = 0
    exchange: PeerLoadExchange

    def load() -> dict:
        nonlocal calls
        calls += 1
        return own_load(ledger, table, names, exchange.peers())

    cfg = PeerLoadConfig(redis_url=url, refresh_ms=refresh_ms, key_prefix="bench", replica_id=f"host-{host}")
    exchange = PeerLoadExchange(cfg, load, worker=worker, registry=CollectorRegistry())
    await exchange.start()
    await asyncio.sleep(warmup)
    print("ready", flush=True)  # the parent starts Redis's window once every child is here
    c0, t0, n0 = time.process_time(), time.perf_counter(), calls
    await asyncio.sleep(duration)
    c1, t1, n1 = time.process_time(), time.perf_counter(), calls
    view = exchange.peers() or {}
    row_bytes = len(encode_row(load()))
    await exchange.stop()
    return {"cpu_per_s": (c1 - c0) / (t1 - t0), "exchanges_per_s": (n1 - n0) / (t1 - t0),
            "row_bytes": row_bytes, "rows_seen": float(len(view.get(names[0], (0,) * 4)[3]) if view else 0)}


def _run(args: argparse.Namespace, refresh_ms: int, port: int) -> dict[str, float]:
    per_host = max(1, args.rows // args.hosts)
    procs = []
    for i in range(args.rows):
        host, worker = divmod(i, per_host)
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "--child", f"redis://127.0.0.1:{port}/0", str(host), str(worker),
             str(args.backends), str(args.entries), str(refresh_ms), str(args.warmup), str(args.duration)],
            stdout=subprocess.PIPE, text=True))
    for p in procs:  # every child started (imports are slow on a busy machine) and exchanging
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    r0, t0 = _redis_cpu(port), time.perf_counter()
    time.sleep(args.duration * 0.9)
    r1, t1 = _redis_cpu(port), time.perf_counter()
    kids = [json.loads(p.communicate()[0]) for p in procs]
    redis_per_s = (r1 - r0) / (t1 - t0)
    total_per_s = sum(k["exchanges_per_s"] for k in kids)
    worker_cpu_each = sum(k["cpu_per_s"] / k["exchanges_per_s"] for k in kids if k["exchanges_per_s"]) / len(kids)
    nominal = 1000.0 / refresh_ms  # exchanges per second per process the refresh asks for
    return {
        "refresh_ms": refresh_ms,
        # CPU per exchange (what a starved machine does not change much), and at the refresh's own rate
        "worker_cpu_ms_per_exchange": 1000 * worker_cpu_each,
        "redis_cpu_ms_per_exchange": 1000 * redis_per_s / total_per_s if total_per_s else 0.0,
        "worker_cpu_at_nominal_rate": worker_cpu_each * nominal,
        "redis_cpu_at_nominal_rate": (redis_per_s / total_per_s if total_per_s else 0.0) * nominal * args.rows,
        "redis_cpu_per_s": (r1 - r0) / (t1 - t0),
        "worker_cpu_per_s": sum(k["cpu_per_s"] for k in kids) / len(kids),
        "worker_cpu_per_s_max": max(k["cpu_per_s"] for k in kids),
        "exchanges_per_s_per_worker": sum(k["exchanges_per_s"] for k in kids) / len(kids),
        "exchanges_per_s_total": sum(k["exchanges_per_s"] for k in kids),
        "row_bytes": kids[0]["row_bytes"],
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        url, host, worker, backends, entries, refresh, warmup, duration = sys.argv[2:10]
        import faulthandler  # a child that hangs says where, and ends
        faulthandler.dump_traceback_later(float(warmup) + float(duration) + 60.0, exit=True)
        out = asyncio.run(_child(url, int(host), int(worker), int(backends), int(entries), int(refresh),
                                 float(warmup), float(duration)))
        print(json.dumps(out))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=8, help="exchanging processes (rows in Redis)")
    ap.add_argument("--hosts", type=int, default=4, help="hosts they belong to (rows / hosts workers each)")
    ap.add_argument("--backends", type=int, default=16)
    ap.add_argument("--entries", type=int, nargs="+", default=[64], help="live requests and ledger entries per backend")
    ap.add_argument("--refresh-ms", type=int, nargs="+", default=[10, 20])
    ap.add_argument("--duration", type=float, default=10.0, help="seconds measured per refresh")
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=2, help="refreshes alternated this many times")
    args = ap.parse_args()
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server not installed (apt-get install -y redis-server)")
    port = _free_port()
    redis_proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                   "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                _redis_cpu(port)
                break
            except Exception:  # noqa: BLE001 - not up yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        results = []
        entries_list = args.entries
        for _ in range(args.rounds):
            for entries, every in [(e, r) for e in entries_list for r in args.refresh_ms]:
                args.entries = entries
                res = _run(args, every, port)
                res["entries"] = entries
                results.append(res)
                print(f"refresh {every} ms, {args.rows} rows x {args.backends} backends x {args.entries} entries "
                      f"(row {res['row_bytes']} bytes): per exchange worker {res['worker_cpu_ms_per_exchange']:.2f} ms, "
                      f"Redis {res['redis_cpu_ms_per_exchange']:.3f} ms CPU; at {1000 / every:.0f}/s each: a worker "
                      f"{100 * res['worker_cpu_at_nominal_rate']:.0f}% of a core, Redis "
                      f"{100 * res['redis_cpu_at_nominal_rate']:.0f}%. Achieved {res['exchanges_per_s_per_worker']:.0f} "
                      f"exchanges/s each: worker {100 * res['worker_cpu_per_s']:.1f}% of a core, Redis "
                      f"{100 * res['redis_cpu_per_s']:.1f}%", flush=True)
        print(json.dumps(results))
    finally:
        redis_proc.terminate()
        redis_proc.wait(5)


if __name__ == "__main__":
    main()
