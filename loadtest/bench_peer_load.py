"""What routing.peer_load costs at a given refresh (issue 13, round 5): a real `redis-server` and `--rows`
processes, each running the proxy's own exchange (`proxy.control.peer_load.PeerLoadExchange`: `own_load`
over a real work ledger and shared in-flight row, `encode_row`, the one Lua round trip, `merge_rows`,
`host_view`) as `--workers` workers of `--hosts` hosts do, every backend with `--entries` live requests
and ledger entries (a full row: the most a row carries). Measured: the CPU each process and Redis spend
per second of wall time and per exchange (process CPU time: a busy machine slows the exchanges, so the
achieved rate may fall short of the refresh, but hardly changes what each one costs), and from that the
cost at the refresh's own rate.

    .venv/bin/python loadtest/bench_peer_load.py --rows 8 --hosts 4 --backends 16 --entries 64 16 --refresh-ms 10 20

`--replay-check SUITE LOAD SEED` re-runs `loadtest/results/scaleout.py run SUITE --only mooncake --load LOAD
--seed SEED` in this tree (or BENCH_TREE's) without writing, and compares every row with the one recorded in
scaleout.jsonl: every field but the replay's own CPU time must be identical (a faster peer load must not
change one decision; rows recorded before round 5's fix of the LRU bound also differ in bound_* and
hit_vs_bound). With REPLAY_CHECK_OUT=FILE every row is also appended to FILE, to compare two trees' runs.

`--pick` measures the other side, a pick (`AffinityPolicy.pick`) with the peer view, in a --workers
worker of one of 4 hosts x 2 workers (16 backends, `--live` requests in flight per backend and process,
the other hosts' rows as the exchange reads them, a mate that routes as often as the worker, a refresh
every 5 picks), in this tree and in `--ab TREE`'s (each in its own interpreter, alternated), next to the
same picks without peer load; `--profile` prints a cProfile of this tree's picks, `--exchange-profile`
of one worker's exchange work without Redis (own row, encode, the other hosts' rows decoded and merged).

    .venv/bin/python loadtest/bench_peer_load.py --pick --live 8 32 --ab ../before-r5 --rounds 3

`--running-weight W` adds, alternated in the same run, this tree's picks at routing.affinity.running_weight
W with the ledgers and the host's table following the engines' progress (what KV events turn on; round 13's
backlog bound, each pick's backend storing 2,000 more tokens), next to the picks without (W = 1: what
following the progress costs at the default weight).

Results: loadtest/results/scaleout.md, Rounds 5 and 5b.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The tree whose proxy package runs (`--ab`: another checkout, in its own interpreter).
TREE = Path(os.environ.get("BENCH_TREE") or ROOT)
sys.path.insert(0, str(TREE))


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

    from proxy.control import peer_load
    from proxy.control.peer_load import PeerLoadExchange, own_load
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
    row_bytes = len(getattr(peer_load, "encode_row_packed", peer_load.encode_row)(load()))
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


_WORDS = "the of and to in is was for on that with as by at from his an were are which this be or".split()


def _text(n: int, rng: random.Random) -> str:
    out, size = [], 0
    while size < n:
        w = rng.choice(_WORDS) + str(rng.randrange(1000))
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n]


class _PickWorld:
    """One --workers worker (w0, row 0 of its host's shared block) with its mate (w1), and the other
    hosts' 6 processes (3 hosts x 2 workers, each a plain replica here: what matters is their rows),
    every process with `live` requests in flight per backend; the worker's policy reads the peer view."""

    def __init__(self, live: int, backends: int, peers: bool, seed: int, weight: float | None = None) -> None:
        from proxy.control import peer_load
        from proxy.control.peer_load import host_view, merge_rows, own_load
        from proxy.core.affinity import AffinityPolicy
        from proxy.core.inflight import InflightTable, SharedInflightTable, SharedLayout
        from proxy.core.routing_config import RoutingConfig
        from proxy.core.snapshot import BackendSpec, Snapshot
        from proxy.core.work_ledger import WorkLedger

        # The row as the tree's exchange publishes it (packed since round 5b, JSON before).
        encode_row = getattr(peer_load, "encode_row_packed", peer_load.encode_row)
        self._encode, self._host_view, self._merge, self._own_load = encode_row, host_view, merge_rows, own_load
        self.rng = random.Random(seed)
        self.names = [f"gpu-{k}" for k in range(backends)]
        self.snap = Snapshot.initial(BackendSpec(n, f"http://10.0.0.{k}:8000") for k, n in enumerate(self.names))
        layout = SharedLayout(rows=2, slots=backends)
        buf = memoryview(bytearray(layout.size))
        self.tables: list[Any] = [SharedInflightTable(buf, layout, 0), SharedInflightTable(buf, layout, 1)]
        for t in self.tables:
            t.assign({n: k for k, n in enumerate(self.names)})
        # The engines' progress (KVIndex.progress), followed with a weight (with KV events), even 1.
        self.progress: dict[str, int] | None = {n: 0 for n in self.names} if weight is not None else None
        if self.progress is not None:
            for t in self.tables:
                t.follow_progress(self.progress)
        self.tables += [InflightTable() for _ in range(6)]
        self.ledgers = [WorkLedger(progress=self.progress) for _ in self.tables]
        self.live: list[list[tuple[str, int]]] = [[] for _ in self.tables]
        self.view: Any = None
        self.seen: list[Any] = [None] * len(self.tables)
        from dataclasses import replace

        cfg = RoutingConfig()
        cfg = replace(cfg, affinity=replace(cfg.affinity, running_weight=1.0 if weight is None else weight))
        self.policy = AffinityPolicy(cfg, work=self.ledgers[0],
                                     peers=(lambda: self.view) if peers else None)
        for epoch in range(3 * live):  # `live` requests per backend and process, over some refreshes
            for p in range(len(self.tables)):
                for n in self.names:
                    if epoch % 3 == p % 3:
                        self.send(p, n, self.rng.choice((200.0, 800.0, 3000.0, 12000.0)), keep=live * backends)
            self.refresh()
        system = _text(2048, self.rng)
        self.bodies = [{"model": "m", "messages": [{"role": "system", "content": system},
                                                   {"role": "user", "content": f"q{i} " + _text(1500, self.rng)}]}
                       for i in range(2000)]

    def send(self, p: int, name: str, uncached: float, keep: int) -> None:
        table = self.tables[p]
        self.ledgers[p].record(name, uncached, table)
        table.acquire(name, 1000)
        self.live[p].append((name, 1000))
        if len(self.live[p]) > keep:
            old, tok = self.live[p].pop(self.rng.randrange(len(self.live[p]) // 2))  # finish out of order
            table.release(old, tok)

    def refresh(self) -> None:
        rows = [self._own_load(led, t, self.names, self.seen[p]) for p, (led, t) in
                enumerate(zip(self.ledgers, self.tables))]
        raw = [self._encode(r) for r in rows]
        hosts = [0, 0, 1, 1, 2, 2, 3, 3]
        for p in range(len(rows)):
            merged = self._merge([raw[q] for q in range(len(rows)) if hosts[q] != hosts[p]])
            self.seen[p] = self._host_view(merged, rows[p]) if p < 2 else merged
        self.view = self.seen[0]


def _pick_child(live: int, backends: int, picks: int, peers: bool, profile: bool,
                weight: float | None = None) -> float:
    from proxy.core.request import summary_from_openai

    world = _PickWorld(live, backends, peers, seed=live, weight=weight)
    keep = live * backends
    reqs = [summary_from_openai("/v1/chat/completions", b) for b in world.bodies]
    pick = world.policy.pick
    snap, table = world.snap, world.tables[0]
    spent = 0.0
    prof = None
    if profile:
        import cProfile
        prof = cProfile.Profile()
    clock = time.thread_time
    for i in range(picks):
        req = reqs[i % len(reqs)]
        if prof is not None:
            prof.enable()
        t0 = clock()
        d = pick(req, snap, table)
        spent += clock() - t0
        if prof is not None:
            prof.disable()
        table.acquire(d.backend, 1000)
        if world.progress is not None:
            world.progress[d.backend] += 2000
            for t in world.tables[:2]:  # each worker's subscriber publishes its count (round 15 on)
                if hasattr(t, "publish_count"):
                    t.publish_count(d.backend)
        world.live[0].append((d.backend, 1000))
        if len(world.live[0]) > keep:
            old, tok = world.live[0].pop(world.rng.randrange(len(world.live[0]) // 2))
            table.release(old, tok)
        world.send(1, world.rng.choice(world.names), world.rng.choice((200.0, 800.0, 3000.0)), keep)  # the mate
        if i % 5 == 4:  # a refresh every 5 picks (500 picks/s at 10 ms); the other hosts route meanwhile
            for p in range(2, 8):
                world.send(p, world.rng.choice(world.names), world.rng.choice((200.0, 800.0, 3000.0)), keep)
            world.refresh()
    if prof is not None:
        import pstats
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(25)
    return 1e6 * spent / picks


def _exchange_profile(live: int, backends: int, rounds: int) -> None:
    """One worker's exchange work per refresh, without Redis: its own row, encoded, the other hosts' 6 rows
    decoded and merged, its view (cProfile, and the µs per exchange)."""
    import cProfile
    import pstats

    world = _PickWorld(live, backends, True, seed=1)
    hosts = [0, 0, 1, 1, 2, 2, 3, 3]
    rows = [world._own_load(led, t, world.names, world.seen[p]) for p, (led, t) in
            enumerate(zip(world.ledgers, world.tables))]
    raw = [world._encode(r) for r in rows]
    others = [raw[q] for q in range(8) if hosts[q] != hosts[0]]
    prof = cProfile.Profile()
    t0 = time.thread_time()
    prof.enable()
    for _ in range(rounds):
        own = world._own_load(world.ledgers[0], world.tables[0], world.names, world.seen[0])
        world._encode(own)
        world.seen[0] = world._host_view(world._merge(others), own)
    prof.disable()
    spent = time.thread_time() - t0
    pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(20)
    print(json.dumps({"us_per_exchange": 1e6 * spent / rounds, "row_bytes": len(raw[0])}))


def _replay_check(suite_name: str, load: str, seed: int) -> int:
    sys.path.insert(0, str(TREE / "loadtest" / "results"))
    import scaleout as so  # loadtest/results/scaleout.py: the tree's configurations and recorded rows

    recorded = {r["key"]: r for r in so._rows()}
    bad = 0
    for entry in so.LOADS:
        name, trace, window, speed, _busy = entry
        if "mooncake" not in name or load != f"{window[0]:g}:{window[1]:g}x{speed:g}":
            continue
        wl = so._workload(trace, window)
        for base in so.suite(suite_name):
            if base.seed != seed:
                continue
            key = so.key_of(entry, base)
            cfg = so.ReplayConfig(**{**base.__dict__, "speed": speed, "max_model_len": 131072})
            result = asyncio.run(so.replay(wl, cfg))
            s = so.summarize(result, wl, label=f"{cfg.policy}{so.scaleout_label(cfg)}")
            row = {"reasons": result.meta["reasons"],
                   **{k: v for k, v in s.items() if isinstance(v, (int, float, str)) or v is None}}
            dump = os.environ.get("REPLAY_CHECK_OUT")  # every field, to compare two trees' runs
            if dump:
                with open(dump, "a") as fh:
                    fh.write(json.dumps({"key": key, **row}) + "\n")
            old = recorded.get(key)
            if old is None:
                print(f"NOT RECORDED {key}")
                bad += 1
                continue
            # The replay's own CPU (proxy_cpu_*) is measured, not decided: it differs run to run.
            measured = [k for k in row if k.startswith("proxy_cpu_")]
            diff = sorted(k for k in row if k in old and row[k] != old[k] and k not in measured)
            missing = sorted(k for k in row if k not in old)
            bad += bool(diff)
            cpu = (f"; proxy CPU µs per request {old['proxy_cpu_us_per_req']:.0f} recorded, "
                   f"{row['proxy_cpu_us_per_req']:.0f} now" if row.get("proxy_cpu_us_per_req") is not None
                   and old.get("proxy_cpu_us_per_req") is not None else "")
            print(f"{'IDENTICAL' if not diff else 'DIFFERENT'} {key}: {len(row) - len(measured)} fields compared"
                  f"{', differ: ' + ', '.join(diff) if diff else ''}{', not recorded: ' + ', '.join(missing) if missing else ''}"
                  f"{cpu}", flush=True)
    return 1 if bad else 0


def _pick_ab(args: argparse.Namespace) -> None:
    import statistics

    # name -> (checkout, running_weight or None: the ledgers without progress, weight 1)
    trees: dict[str, tuple[str, float | None]] = {"this": (str(ROOT), None)}
    if args.ab:
        trees = {"base": (os.path.abspath(args.ab), None), **trees}
    weighted = f"weight {args.running_weight:g}"
    if args.running_weight is not None:
        trees[weighted] = (str(ROOT), args.running_weight)
        if args.ab:
            trees[f"base {weighted}"] = (os.path.abspath(args.ab), args.running_weight)
    res: dict[tuple[str, int, bool], list[float]] = {}
    for r in range(args.rounds):
        order = list(trees) if r % 2 == 0 else list(trees)[::-1]
        for live in args.live:
            for name in order:
                for peers in (True, False):
                    tree, w = trees[name]
                    weight = [str(w)] if w is not None else []
                    out = subprocess.run(
                        [sys.executable, "-P", __file__, "--pick-child", str(live), str(args.backends), str(args.picks),
                         "1" if peers else "0", *weight], env=dict(os.environ, BENCH_TREE=tree),
                        capture_output=True, text=True, check=True).stdout
                    res.setdefault((name, live, peers), []).append(float(out.strip().splitlines()[-1]))
        print(f"round {r} done", file=sys.stderr, flush=True)
    print(f"µs per pick (median of {args.rounds} rounds, thread CPU time)")

    def ratio(a: str, b: str, live: int, peers: bool) -> float:
        return statistics.median([x / y for x, y in zip(res[(a, live, peers)], res[(b, live, peers)])])

    for live in args.live:
        line = [f"live {live:3d}/backend/process:"]
        for name in trees:
            w = statistics.median(res[(name, live, True)])
            wo = statistics.median(res[(name, live, False)])
            line.append(f"{name}: {w:6.1f} with peers, {wo:5.1f} without ({w / wo:.2f}x)")
        if args.ab:
            line.append(f"this/base with peers {ratio('this', 'base', live, True):.3f}")
            if args.running_weight is not None:
                for peers in (True, False):
                    line.append(f"at {weighted} this/base {'with' if peers else 'without'} peers "
                                f"{ratio(weighted, f'base {weighted}', live, peers):.3f}")
        if args.running_weight is not None:
            for peers in (True, False):
                line.append(f"{weighted}/this {'with' if peers else 'without'} peers "
                            f"{ratio(weighted, 'this', live, peers):.3f}")
        print("  ".join(line), flush=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        url, host, worker, backends, entries, refresh, warmup, duration = sys.argv[2:10]
        import faulthandler  # a child that hangs says where, and ends
        faulthandler.dump_traceback_later(float(warmup) + float(duration) + 60.0, exit=True)
        out = asyncio.run(_child(url, int(host), int(worker), int(backends), int(entries), int(refresh),
                                 float(warmup), float(duration)))
        print(json.dumps(out))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--replay-check":
        raise SystemExit(_replay_check(sys.argv[2], sys.argv[3], int(sys.argv[4])))
    if len(sys.argv) > 1 and sys.argv[1] == "--pick-child":
        live, backends, picks, peers = (int(x) for x in sys.argv[2:6])
        weight = float(sys.argv[6]) if len(sys.argv) > 6 and not sys.argv[6].startswith("--") else None
        print(_pick_child(live, backends, picks, bool(peers), "--profile" in sys.argv, weight))
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
    ap.add_argument("--pick", action="store_true", help="measure a pick with the peer view (no Redis)")
    ap.add_argument("--live", type=int, nargs="+", default=[8, 32], help="--pick: live requests per backend and process")
    ap.add_argument("--picks", type=int, default=4000)
    ap.add_argument("--ab", help="--pick: also this other checkout's code, alternated")
    ap.add_argument("--profile", action="store_true", help="--pick: a cProfile of this tree's picks")
    ap.add_argument("--running-weight", type=float, help="--pick: also this tree's picks at this running_weight")
    ap.add_argument("--exchange-profile", action="store_true", help="cProfile of one worker's exchange work")
    args = ap.parse_args()
    if args.exchange_profile:
        _exchange_profile(args.live[0], args.backends, 300)
        return
    if args.pick and args.profile:
        print(_pick_child(args.live[0], args.backends, args.picks, True, True))
        return
    if args.pick:
        _pick_ab(args)
        return
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
