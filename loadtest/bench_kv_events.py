"""KV-event subscriber CPU: what one proxy process spends keeping its precise index in step with the engines.

    python -m loadtest.bench_kv_events [--workload PATH] [--window 900:1200] [--speed 1] [--encoding array,map]
        [--pace 10] [--drain-interval-ms 0,250] [--repeat 2] [--frames-out F | --frames-in F] [--out results.json]

Every `--workers` worker (and every replica) runs its own subscriber to every engine, so this cost is paid
once per process (issue 13). The stream is real: the offline replay (`loadtest.replay`, R = 1, precise index,
the proxy's defaults) of the window, every engine step's KV-cache events encoded as vLLM publishes them
(`sim.kv_events.encode_batch`: `[topic, seq, msgpack EventBatch]`, sequence numbers per engine).
`--frames-out` saves it, `--frames-in` replays a saved one (the same stream for an A/B against another tree).

Two measurements per encoding (positional arrays, vLLM <= 0.10; tagged maps, vLLM main):

- ``messages``: `KVEventSubscriber.on_message` for every message in order, no sockets: decoding, the
  sequence checks and the index updates, in this thread's CPU time;
- ``sockets``: a publisher process sends the stream over PUB/SUB on 127.0.0.1 (one socket per engine), paced
  at `--pace` times the window's real time, to a `KVEventSubscriber` started in this process the way the
  proxy starts it; this process's CPU (getrusage: the event loop, ZeroMQ's I/O thread, decoding, the index)
  from the first message sent to the last one applied, and in brackets the event loop's thread alone (the
  rest is ZeroMQ's I/O thread). That is what a worker pays, idle wake-ups included. `--drain-interval-ms`
  compares the subscriber's `drain_interval_ms` settings (alternated run by run); no pick drains here, so a
  setting > 0 applies everything on its timer;
- ``drain``: what `drain()`, which the router calls before every pick in drained mode, costs per pick with
  `--subscriptions` SUB sockets on which nothing arrived (one poll of their descriptors, not one ZMQ_EVENTS
  read each).

Both check the index ends holding what the engines hold (blocks per engine), so a faster path that drops
events fails here. Reported per batch, per event and per request of the window, with the best of
`--repeat` runs (the machine is shared: the lowest is the least disturbed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import msgpack
import uvloop
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from loadtest.replay import ReplayConfig, make_profile, replay
from loadtest.run import add_workload_args, prepare_workload
from proxy.control.kv_events import KVEventSubscriber
from proxy.control.telemetry_config import KVEventsEndpoint
from proxy.core.kv_index import KVIndex
from sim.kv_events import ENCODINGS, encode_batch

MODEL = "llama3-8b"


@dataclass
class Stream:
    """The window's KV-event messages, in the order the engines sent them."""

    requests: int
    block_size: int
    # (backend, virtual time sent, [topic, seq, payload]) per encoding
    messages: dict[str, list[tuple[str, float, list[bytes]]]]
    engine_blocks: dict[str, int]  # what each engine holds at the end (the index must agree)

    def save(self, path: str) -> None:
        with open(path, "wb") as f:
            f.write(msgpack.packb({"requests": self.requests, "block_size": self.block_size,
                                   "messages": self.messages, "engine_blocks": self.engine_blocks},
                                  use_bin_type=True))

    @classmethod
    def load(cls, path: str) -> Stream:
        with open(path, "rb") as f:
            d = msgpack.unpackb(f.read(), raw=False)
        msgs = {enc: [(b, t, list(fr)) for b, t, fr in rows] for enc, rows in d["messages"].items()}
        return cls(d["requests"], d["block_size"], msgs, d["engine_blocks"])


def record(args: argparse.Namespace, encodings: list[str]) -> Stream:
    workload = prepare_workload(args)
    cfg = ReplayConfig(policy="affinity", backends=args.backends, max_model_len=args.max_model_len,
                       speed=args.speed, model=MODEL, index="precise")
    taps: list[tuple[str, float, list[Any]]] = []
    result = asyncio.run(replay(workload, cfg, kv_tap=lambda name, t, events: taps.append((name, t, list(events)))))
    meta = result.meta["kv_index"]
    block_size = make_profile(cfg.profile, cfg.max_model_len, {}).block_size
    messages: dict[str, list[tuple[str, float, list[bytes]]]] = {}
    for enc in encodings:
        seqs: dict[str, int] = {}
        rows = []
        for name, t, events in taps:
            seq = seqs.get(name, 0)
            seqs[name] = seq + 1
            payload = encode_batch(events, t, enc, block_size)  # type: ignore[arg-type]
            rows.append((name, t, [b"", seq.to_bytes(8, "big"), payload]))
        messages[enc] = rows
    return Stream(len(result.records), block_size, messages,
                  {n: m["engine_cached_blocks"] for n, m in meta.items()})


def _subscriber(names: list[str], endpoints: dict[str, str] | None = None, drain_interval_s: float = 0.0
                ) -> tuple[KVEventSubscriber, KVIndex]:
    index = KVIndex(eviction_ages=True)  # as the proxy builds it (routing.affinity.eviction_band_tokens > 0)
    eps = {n: KVEventsEndpoint(endpoint=(endpoints or {}).get(n, "tcp://127.0.0.1:1"), model=MODEL) for n in names}
    sub = KVEventSubscriber(index, eps, models={n: MODEL for n in names}, registry=CollectorRegistry(),
                            stale_after_s=0, drain_interval_s=drain_interval_s)
    return sub, index


def _check(index: KVIndex, stream: Stream) -> None:
    got = {n: index.num_blocks(n) for n in stream.engine_blocks}
    if got != stream.engine_blocks:
        raise SystemExit(f"the index ended with {got} blocks, the engines hold {stream.engine_blocks}")


def bench_messages(stream: Stream, enc: str) -> float:
    """CPU seconds (this thread) for on_message over the whole stream."""
    rows = stream.messages[enc]
    sub, index = _subscriber(sorted(stream.engine_blocks))

    async def run() -> float:
        t0 = time.thread_time()
        for name, _t, frames in rows:
            await sub.on_message(name, frames)
        return time.thread_time() - t0

    cpu = uvloop.run(run())
    _check(index, stream)
    return cpu


_PUBLISHER = r"""
import sys, time, msgpack, zmq
path, enc, pace = sys.argv[1], sys.argv[2], float(sys.argv[3])
with open(path, "rb") as f:
    rows = msgpack.unpackb(f.read(), raw=False)["messages"][enc]
names = sorted({r[0] for r in rows})
ctx = zmq.Context()
socks = {}
for n in names:
    s = ctx.socket(zmq.PUB); s.setsockopt(zmq.SNDHWM, 0); s.setsockopt(zmq.LINGER, 5000)
    port = s.bind_to_random_port("tcp://127.0.0.1"); socks[n] = s
    print(n, port, flush=True)
sys.stdin.readline()  # the subscriber is connected
t0 = time.monotonic(); v0 = rows[0][1]
for n, t, frames in rows:
    wait = (t - v0) / pace - (time.monotonic() - t0)
    if wait > 0:
        time.sleep(wait)
    socks[n].send_multipart(frames)
print("sent", flush=True)
sys.stdin.readline()
"""


def bench_sockets(stream: Stream, enc: str, path: str, pace: float, drain_interval_s: float = 0.0
                  ) -> tuple[float, float, float]:
    """(CPU seconds of this process, of its event loop's thread, wall seconds) from the first message sent
    to the last one applied; the rest of the process's CPU is ZeroMQ's I/O thread."""
    names = sorted(stream.engine_blocks)
    total = len(stream.messages[enc])
    pub = subprocess.Popen([sys.executable, "-c", _PUBLISHER, path, enc, str(pace)], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
    assert pub.stdin is not None and pub.stdout is not None
    try:
        ports = dict(pub.stdout.readline().split() for _ in names)
        sub, index = _subscriber(names, {n: f"tcp://127.0.0.1:{ports[n]}" for n in names}, drain_interval_s)
        def applied() -> int:  # batches applied so far (each engine's next expected sequence number)
            status = sub.status()
            return sum(int(status[n]["expected_seq"] or 0) for n in names)

        async def run() -> tuple[float, float, float]:
            await sub.start()
            await asyncio.sleep(0.5)  # PUB/SUB: the subscriptions reach the publisher
            ru0 = resource.getrusage(resource.RUSAGE_SELF)
            th0 = time.thread_time()
            t0 = time.monotonic()
            wall_hint = (stream.messages[enc][-1][1] - stream.messages[enc][0][1]) / pace
            pub.stdin.write("go\n")
            pub.stdin.flush()
            while applied() < total:
                # (seldom: this wake-up and its status() count against the loop's CPU measured)
                await asyncio.sleep(0.05 if time.monotonic() - t0 > wall_hint else 0.5)
                if time.monotonic() - t0 > 600:
                    raise SystemExit(f"only {applied()} of {total} batches applied after 600 s")
            ru1 = resource.getrusage(resource.RUSAGE_SELF)
            loop_cpu = time.thread_time() - th0
            wall = time.monotonic() - t0
            await sub.stop()
            return (ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime), loop_cpu, wall

        cpu, loop_cpu, wall = uvloop.run(run())  # the proxy's loop
        _check(index, stream)
        return cpu, loop_cpu, wall
    finally:
        pub.stdin.write("\n")
        pub.stdin.flush()
        pub.wait(10)


def bench_drain(subscriptions: int, picks: int = 5000) -> float:
    """µs of CPU per `drain()` (what the router calls before every pick) with `subscriptions` SUB sockets
    on which nothing arrived: the cost every pick pays in drained mode, whatever the fleet's size."""

    async def run() -> float:
        ctx = zmq.asyncio.Context()
        pub = ctx.socket(zmq.PUB)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        names = [f"sim-{i}" for i in range(subscriptions)]
        sub, _index = _subscriber(names, {n: f"tcp://127.0.0.1:{port}" for n in names}, drain_interval_s=60.0)
        try:
            await sub.start()
            await asyncio.sleep(0.3)  # connected: what the connections signalled is read once
            sub.drain()
            t0 = time.thread_time()
            for _ in range(picks):
                sub.drain()
            return (time.thread_time() - t0) / picks * 1e6
        finally:
            await sub.stop()
            pub.close(0)
            ctx.destroy(0)

    return uvloop.run(run())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.set_defaults(workload=os.path.join(os.path.dirname(__file__), "..", "..", "shared", "traces",
                                          "mooncake_synthetic_trace.jsonl"), window="900:1200")
    ap.add_argument("--speed", type=float, default=1.0)
    ap.add_argument("--backends", type=int, default=4)
    ap.add_argument("--max-model-len", type=int, default=131072)
    ap.add_argument("--encoding", default=",".join(ENCODINGS), help="comma list of array, map")
    ap.add_argument("--pace", type=float, default=10.0, help="the sockets run sends at this many times real time")
    ap.add_argument("--drain-interval-ms", default="0",
                    help="sockets: comma list of the subscriber's drain_interval_ms (0: each message as it "
                         "arrives); the runs alternate between them")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--modes", default="messages,sockets",
                    help="comma list of messages, sockets, drain (a pick's drain() over quiet sockets)")
    ap.add_argument("--subscriptions", default="4,16,64", help="drain: comma list of subscription counts")
    ap.add_argument("--frames-out", help="save the recorded stream here")
    ap.add_argument("--frames-in", help="use a stream saved with --frames-out instead of recording one")
    ap.add_argument("--out", help="write the rows (JSON) here")
    args = ap.parse_args(argv)
    encodings = [e for e in args.encoding.split(",") if e]
    modes = [m for m in args.modes.split(",") if m]
    if args.frames_in:
        stream = Stream.load(args.frames_in)
        path = args.frames_in
    else:
        print(f"recording the stream: replay of {args.workload} {args.window} x{args.speed} ...", file=sys.stderr)
        stream = record(args, encodings)
        path = args.frames_out or os.path.join(os.environ.get("TMPDIR", "/tmp"), f"kv-frames-{os.getpid()}.msgpack")
        stream.save(path)
    first = stream.messages[encodings[0]]
    events = sum(len(msgpack.unpackb(fr[2], raw=False)[1 if encodings[0] == "array" else "events"])
                 for _n, _t, fr in first)
    print(f"stream: {stream.requests} requests, {len(first)} batches, {events} events, block size {stream.block_size}",
          file=sys.stderr)
    drains = [int(x) for x in args.drain_interval_ms.split(",") if x.strip()]
    rows = []
    drain_rows = []
    if "drain" in modes:
        for n in (int(x) for x in args.subscriptions.split(",") if x.strip()):
            got = [bench_drain(n) for _ in range(args.repeat)]
            print(f"  drain, {n} subscriptions: {' / '.join(f'{g:.2f}' for g in got)} µs per pick", file=sys.stderr)
            drain_rows.append({"mode": "drain", "subscriptions": n, "us_per_pick": got})
    for enc in encodings:
        for mode in (m for m in modes if m != "drain"):
            variants = drains if mode == "sockets" else [None]
            # (process CPU, event loop thread's CPU) per variant, the variants alternated run by run
            runs: dict[int | None, list[tuple[float, float]]] = {d: [] for d in variants}
            for k in range(args.repeat):
                for drain in variants:
                    if drain is None:
                        cpu = bench_messages(stream, enc)
                        runs[drain].append((cpu, cpu))
                        print(f"  {enc} {mode} run {k + 1}/{args.repeat}: {cpu:.3f} s CPU", file=sys.stderr)
                    else:
                        cpu, loop_cpu, wall = bench_sockets(stream, enc, path, args.pace, drain / 1000.0)
                        runs[drain].append((cpu, loop_cpu))
                        print(f"  {enc} {mode} drain {drain} ms, run {k + 1}/{args.repeat}: {cpu:.3f} s CPU "
                              f"({loop_cpu:.3f} s in the loop's thread) over {wall:.1f} s", file=sys.stderr)
            for drain, got in runs.items():
                best, best_loop = min(got)
                n = len(stream.messages[enc])
                rows.append({"encoding": enc, "mode": mode, "drain_interval_ms": drain,
                             "cpu_s": [c for c, _ in got], "loop_cpu_s": [c for _, c in got], "batches": n,
                             "events": events, "requests": stream.requests, "us_per_batch": best / n * 1e6,
                             "loop_us_per_batch": best_loop / n * 1e6, "us_per_event": best / events * 1e6,
                             "ms_per_request": best / stream.requests * 1e3})
    print("\n| encoding | measured | drain interval | CPU, best of runs | µs per batch (in the loop's thread) | "
          "µs per event | ms per request of the window |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        drain = "-" if r["drain_interval_ms"] is None else f"{r['drain_interval_ms']} ms"
        print(f"| {r['encoding']} | {r['mode']} | {drain} | {min(r['cpu_s']):.2f} s | {r['us_per_batch']:.0f} "
              f"({r['loop_us_per_batch']:.0f}) | {r['us_per_event']:.1f} | {r['ms_per_request']:.2f} |")
    if drain_rows:
        print("\n| subscriptions (nothing arrived) | µs of CPU per pick's drain(), best of runs |\n|---|---|")
        for r in drain_rows:
            print(f"| {r['subscriptions']} | {min(r['us_per_pick']):.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"workload": args.workload, "window": args.window, "speed": args.speed, "rows": rows,
                       "drain": drain_rows}, f, indent=1)
    if not args.frames_in and not args.frames_out:
        os.unlink(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
