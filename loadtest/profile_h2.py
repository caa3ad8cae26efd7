"""Where one plain HTTP/2 (h2c) request's CPU goes: the proxy in this process, a real h2 client outside it.

Two fake OpenAI backends (the peers harness's `fake_backend.py`) and the load generator (`h2load` for h2c,
`wrk` for HTTP/1.1, for comparison) run as child processes; the proxy runs here, on uvloop, so that
`cProfile` (on the thread's CPU clock, so waits are not charged) sees every function it runs, and the
counters below see every h2 event, transport write and read:

    .venv/bin/python -m loadtest.profile_h2 --proto h2c --secs 5 --top 40
    .venv/bin/python -m loadtest.profile_h2 --proto h2c --secs 5 --no-profile   # CPU µs/request only

Printed: requests, this process's CPU µs per request (getrusage, children excluded), per request: the
client connection's reads, writes, h2 events by kind, backend writes; then (with profiling) the functions
by own time, as µs per request, and grouped by package (h2, hpack, hyperframe, proxy/grpc, ...).
CPU per request is inflated under cProfile; read the shares, and the `--no-profile` figure for totals.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import cProfile
import os
import pstats
import re
import resource
import socket
import subprocess
import sys
import time
from typing import Any

H2_BODY = (b'{"model":"fake-model","prompt":"System prompt 1: You are a helpful assistant. ' + b"a" * 150 +
           b' user question 0-1","max_tokens":16,"temperature":0}')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Counts:
    """Per-request counters, patched onto the h2 side's methods (a few hundred ns each)."""

    def __init__(self) -> None:
        self.c: collections.Counter[str] = collections.Counter()
        self.on = False

    def install(self) -> None:
        from proxy.grpc import downstream
        from proxy.grpc.connection import H2Side

        counts = self.c
        me = self
        orig_receive = H2Side.receive
        orig_write_out = H2Side.write_out
        orig_data_received = downstream.Downstream.data_received

        def receive(side: Any, data: bytes) -> list:
            events = orig_receive(side, data)
            if me.on and isinstance(side, downstream.Downstream):
                for ev in events:
                    counts["event " + type(ev).__name__] += 1
            return events

        def write_out(side: Any) -> None:
            if me.on and side.transport is not None:
                n = len(side.conn._data_to_send)  # noqa: SLF001  # only counting
                if n:
                    counts["client writes" if isinstance(side, downstream.Downstream) else "h2 backend writes"] += 1
                    counts["client bytes out" if isinstance(side, downstream.Downstream) else "h2 backend bytes"] += n
            orig_write_out(side)

        def data_received(side: Any, data: bytes) -> None:
            if me.on:
                counts["client reads"] += 1
                counts["client bytes in"] += len(data)
            orig_data_received(side, data)

        H2Side.receive = receive  # type: ignore[method-assign]  # a profiling tool's counters
        H2Side.write_out = write_out  # type: ignore[method-assign]
        downstream.Downstream.data_received = data_received  # type: ignore[method-assign]
        try:  # the HTTP/1.1 relay pool's backend writes, where it has a protocol class with a transport
            from proxy.upstream import http1

            for name in dir(http1):
                cls = getattr(http1, name)
                if isinstance(cls, type) and issubclass(cls, asyncio.Protocol) and cls.__module__ == http1.__name__:
                    orig = cls.data_received

                    def dr(self: Any, data: bytes, _orig: Any = orig) -> None:
                        if me.on:
                            counts["backend reads"] += 1
                        _orig(self, data)

                    cls.data_received = dr  # type: ignore[method-assign]
        except ImportError:
            pass


def group_of(filename: str) -> str:
    if "site-packages/" in filename:
        pkg = filename.split("site-packages/", 1)[1].split("/", 1)[0]
        return pkg.split(".")[0]
    m = re.search(r"/(proxy/[a-z_]+)", filename)
    if m:
        return m.group(1)
    if filename.startswith("~") or filename.startswith("<"):
        return "builtins"
    return os.path.basename(filename)


async def run(args: argparse.Namespace) -> None:
    from proxy.app import AffinityProxy
    from proxy.config import parse_config

    peers = args.peers_dir
    fake_py = os.path.join(os.environ.get("PEERS_VENV", os.path.expanduser("~/.cache/peers/venv")), "bin", "python")
    backends = [free_port(), free_port()]
    procs = [subprocess.Popen(["taskset", "-c", args.load_cpus, fake_py, os.path.join(peers, "fake_backend.py"),
                               "--port", str(p), "--chunks", "16"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for p in backends]
    port = free_port()
    yaml = (f"listen: {{host: 127.0.0.1, port: {port}}}\nadmin: {{host: 127.0.0.1, port: {free_port()}}}\n"
            "backends:\n" + "".join(f"  - {{name: be{i}, url: 'http://127.0.0.1:{p}'}}\n" for i, p in enumerate(backends))
            + f"routing: {{policy: {args.policy}}}\n")
    proxy = AffinityProxy(parse_config(yaml))
    body_file = f"/tmp/profile_h2_body_{os.getpid()}.json"
    with open(body_file, "wb") as f:
        f.write(H2_BODY)
    lua = os.path.join(peers, "post_completions.lua")
    counts = Counts()
    if args.count:
        counts.install()
    try:
        for _ in range(100):
            try:
                for p in backends:
                    socket.create_connection(("127.0.0.1", p), timeout=0.2).close()
                break
            except OSError:
                await asyncio.sleep(0.1)
        await proxy.start()

        async def load(secs: float) -> int:
            if args.proto == "h2c":
                cmd = ["h2load", "-t1", f"-c{args.conns}", f"-m{args.streams}", "-D", str(secs), "-d", body_file,
                       "-H", "content-type: application/json", f"http://127.0.0.1:{port}/v1/completions"]
            else:
                cmd = ["wrk", "-t1", f"-c{args.conns * args.streams}", f"-d{secs}s", "-s", lua,
                       f"http://127.0.0.1:{port}"]
            p = await asyncio.create_subprocess_exec("taskset", "-c", args.load_cpus, *cmd,
                                                     stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
            out = (await p.communicate())[0].decode()
            if args.proto == "h2c":
                m = re.search(r"requests: \d+ total, \d+ started, \d+ done, (\d+) succeeded", out)
            else:
                m = re.search(r"(\d+) requests in", out)
                if m and "Non-2xx" in out:
                    raise SystemExit("wrk saw non-2xx answers:\n" + out)
            if m is None:
                raise SystemExit("unexpected load generator output:\n" + out)
            return int(m.group(1))

        await load(1)  # warm-up
        prof = cProfile.Profile(time.thread_time) if args.profile else None
        counts.on = True
        c0 = cpu_s()
        if prof is not None:
            prof.enable()
        n = await load(args.secs)
        if prof is not None:
            prof.disable()
        c1 = cpu_s()
        counts.on = False
        print(f"{args.proto} {args.policy}: {n} requests, {(c1 - c0) / max(n, 1) * 1e6:.1f} µs CPU per request"
              f"{' (under cProfile)' if prof else ''}")
        for k, v in sorted(counts.c.items()):
            print(f"  {k}: {v / max(n, 1):.3f} per request")
        if prof is not None:
            st = pstats.Stats(prof)
            rows = []
            groups: collections.Counter[str] = collections.Counter()
            total = 0.0
            for (fn, line, name), (cc, nc, tt, ct, _) in st.stats.items():  # type: ignore[attr-defined]
                rows.append((tt, ct, nc, f"{group_of(fn)}:{os.path.basename(fn)}:{line}:{name}"))
                groups[group_of(fn)] += tt
                total += tt
            print(f"\nprofiled CPU: {total / n * 1e6:.1f} µs per request; by package (own time):")
            for g, t in groups.most_common(20):
                print(f"  {g:30s} {t / n * 1e6:7.1f} µs  {100 * t / total:5.1f}%")
            print(f"\ntop {args.top} functions by own time (µs per request: own, cumulative; calls per request):")
            for tt, ct, nc, name in sorted(rows, reverse=True)[:args.top]:
                print(f"  {tt / n * 1e6:7.2f} {ct / n * 1e6:8.2f} {nc / n:6.2f}  {name}")
            if args.cumulative:
                print(f"\ntop {args.cumulative} by cumulative time:")
                for tt, ct, nc, name in sorted(rows, key=lambda r: -r[1])[:args.cumulative]:
                    print(f"  {tt / n * 1e6:7.2f} {ct / n * 1e6:8.2f} {nc / n:6.2f}  {name}")
            if args.dump:
                prof.dump_stats(args.dump)
    finally:
        await proxy.stop()
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=10)
        os.unlink(body_file)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--proto", choices=["h2c", "h1"], default="h2c")
    ap.add_argument("--policy", default="round_robin")
    ap.add_argument("--secs", type=int, default=5)
    ap.add_argument("--conns", type=int, default=16)
    ap.add_argument("--streams", type=int, default=4, help="h2c: concurrent streams per connection (h1: x conns)")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--cumulative", type=int, default=0)
    ap.add_argument("--no-profile", dest="profile", action="store_false")
    ap.add_argument("--no-count", dest="count", action="store_false")
    ap.add_argument("--dump", help="write the cProfile stats here")
    ap.add_argument("--cpus", default="0", help="the proxy's core (this process)")
    ap.add_argument("--load-cpus", default="1", help="backends' and load generator's cores")
    ap.add_argument("--peers-dir", default=os.environ.get("PEERS_DIR", "/work/shared/peers"))
    args = ap.parse_args()
    os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    import uvloop

    uvloop.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
