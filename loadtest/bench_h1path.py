"""The HTTP/1.1 data plane's CPU per small request, in process, without sockets: a lever's A/B on a busy machine.

A real `AffinityProxy` (the tree on PYTHONPATH, default config but telemetry and health checks off) serves
requests that a fake client transport feeds to `HttpDataPlane.protocol()`; its relay pool holds pre-made
upstream connections on fake transports that answer each request with a fake backend's small JSON answer
on the next loop turn (as a loopback backend would). No syscalls (bar the access log, sent to /dev/null),
no other process: what is timed is the proxy's own Python work per request, the part that separates it
from the Rust routers (issue 19), so process CPU time over a few thousand requests is steady to ~1% even
when the machine is busy, where the socket benchmark (`bench_peers.py --ab`) needs many rounds.

    .venv/bin/python loadtest/bench_h1path.py --ab /work/wt/before-h1 --policy round_robin --rounds 8

runs this tree and the baseline tree in alternating subprocesses (ABAB...) and prints the median of the
per-round ratios (this / baseline) and how many rounds were lower. `--profile FILE` writes a cProfile of
one run; `--count` prints loop turns (epoll-less: callbacks scheduled), tasks and futures per request;
`--without PIECE` (repeatable) runs without one piece (observability, the access log, the hot-spot windows,
the summary, the outlier report, the retry controller): what it costs where it runs, not timed alone.
`--headers sdk` sends the 16-field head of the OpenAI Python SDK instead of wrk's 3 fields (a per-field cost, as
the request parser's, weighs more for a real client).
It is a guide, not the contract: a change is kept on `bench_peers.py --ab` (real sockets, wrk).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

# The head wrk sends in bench_peers (3 fields), and the head the OpenAI Python SDK sends (16 fields; what a
# per-field cost, e.g. the request parser's, weighs for a real client): --headers wrk|sdk.
HEADS = {
    "wrk": (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s"),
    "sdk": (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nAccept-Encoding: gzip, deflate\r\n"
            b"Connection: keep-alive\r\nAccept: application/json\r\nContent-Type: application/json\r\n"
            b"User-Agent: OpenAI/Python 1.51.0\r\nX-Stainless-Lang: python\r\nX-Stainless-Package-Version: 1.51.0\r\n"
            b"X-Stainless-OS: Linux\r\nX-Stainless-Arch: x64\r\nX-Stainless-Runtime: CPython\r\n"
            b"X-Stainless-Runtime-Version: 3.11.9\r\nAuthorization: Bearer sk-xxxxxxxxxxxxxxxx\r\n"
            b"X-Stainless-Async: false\r\nx-stainless-retry-count: 0\r\nContent-Length: %d\r\n\r\n%s"),
}
REQUEST = HEADS["wrk"]
PREFIX = "System prompt %d: You are a helpful assistant. " + "x" * 150
ANSWER_BODY = json.dumps({
    "id": "cmpl-fake", "object": "text_completion", "created": 0, "model": "fake-model",
    "choices": [{"index": 0, "text": " fake fake fake fake fake fake", "finish_reason": "length"}],
    "usage": {"prompt_tokens": 8, "completion_tokens": 6, "total_tokens": 14}}).encode()
ANSWER = (b"HTTP/1.1 200 OK\r\nServer: fake-backend\r\nContent-Type: application/json\r\n"
          b"Content-Length: %d\r\n\r\n%s" % (len(ANSWER_BODY), ANSWER_BODY))


class _ClientTransport(asyncio.Transport):
    """What the proxy writes to its client; a complete answer wakes the driver."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self.loop = loop
        self.buf = bytearray()
        self.waiter: asyncio.Future[None] | None = None
        self.closing = False
        self.answers = 0

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 40000) if name == "peername" else default

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = bytes(self.buf[:end]).lower()
        i = head.find(b"content-length: ")
        length = int(head[i + 16:].split(b"\r\n", 1)[0]) if i >= 0 else 0
        if len(self.buf) >= end + 4 + length:
            if not head.startswith(b"http/1.1 200"):
                raise SystemExit(f"unexpected answer: {bytes(self.buf[:200])!r}")
            del self.buf[:end + 4 + length]
            self.answers += 1
            w = self.waiter
            if w is not None and not w.done():
                w.set_result(None)

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.closing = True

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.closing = True

    def get_write_buffer_size(self) -> int:
        return 0

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class _UpstreamTransport(asyncio.Transport):
    """A backend on the other end: a complete request is answered on the next loop turn."""

    def __init__(self, loop: asyncio.AbstractEventLoop, protocol: asyncio.Protocol) -> None:
        super().__init__()
        self.loop = loop
        self.protocol = protocol
        self.closing = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.loop.call_soon(self.protocol.data_received, ANSWER)

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.closing = True

    def get_write_buffer_size(self) -> int:
        return 0

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


# `--without PIECE`: what one piece costs where it runs (in situ), by running without it. Each takes the piece
# off the serving proxy's own objects after start-up; answers stay 200 (the piece's output is what is lost).
WITHOUT = ("observability", "access_log", "hotspot_windows", "summary", "outcome_report", "retries")


# The pieces taken off by replacing a method of a serving object: a compiled object's methods cannot be
# replaced, so with the compiled hot path (proxy/native) these run only with AFFINITY_PROXY_NATIVE=0.
PATCHED = ("hotspot_windows", "summary")


def _take_off(plane: Any, piece: str) -> None:
    pipeline = plane.pipeline
    if piece in PATCHED:
        from proxy.native.loader import status

        if status().active:
            raise SystemExit(f"--without {piece} replaces a method of a compiled object: run the bench with "
                             "AFFINITY_PROXY_NATIVE=0 (the Python source) to take it off")
    if piece == "observability":  # access log, hot-spot windows, traces: every RequestObservation call
        pipeline.observability = None
    elif piece == "access_log":
        pipeline.observability.observer.access_log = None
    elif piece == "hotspot_windows":  # Observer.on_finish without the windows: the access-log line only
        observer = pipeline.observability.observer
        log = observer.access_log

        def on_finish(record: Any) -> None:
            now = observer._clock()
            if record.time is None:
                record.time = now
            observer._pending.pop(id(record), None)
            if log is not None:
                log.write(record, now)
        observer.on_finish = on_finish
    elif piece == "summary":  # parse_json + summary_from_openai: the first request's summary, reused
        first: list[Any] = []
        summarise = pipeline.summarise

        def reuse(req: Any) -> Any:
            if not first:
                first.append(summarise(req))
            return first[0]
        pipeline.summarise = reuse
    elif piece == "outcome_report":  # passive outlier detection's report after every attempt
        pipeline.router.on_outcome = None
    elif piece == "retries":  # the retry controller: budget accounting per request, status check per answer
        pipeline.retries = None
    else:
        raise SystemExit(f"--without: one of {', '.join(WITHOUT)}")


async def _run(policy: str, requests: int, conns: int, profile: str | None, count: bool,
               parts: bool = False, without: tuple[str, ...] = ()) -> dict[str, float]:
    from proxy.app import AffinityProxy
    from proxy.config import parse_config
    from proxy.upstream import http1 as up

    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    text = ("listen: {host: 127.0.0.1, port: 0}\nadmin: {host: 127.0.0.1, port: 0}\ntelemetry: {enabled: false}\n"
            "health_checks: {enabled: false}\n" f"routing: {{policy: {policy}}}\nbackends:\n"
            + "".join(f"  - {{name: be{i}, url: '{u}'}}\n" for i, u in enumerate(urls)))
    proxy = AffinityProxy(parse_config(text))
    await proxy.start()
    loop = asyncio.get_running_loop()
    plane = proxy.http
    assert plane is not None
    for piece in without:
        _take_off(plane, piece)
    pool = plane.pipeline.pool
    for url in urls:  # pre-made upstream connections, one per client connection and backend
        b = pool.backend(url)
        for _ in range(conns):
            conn = up._Connection(pool, b)
            conn.connection_made(_UpstreamTransport(loop, conn))
            b.open += 1
            conn.idle_since = time.monotonic()
            b.idle.append(conn)

    def body(i: int, c: int) -> bytes:
        return json.dumps({"model": "fake-model", "prompt": PREFIX % (i % 8) + f" user question {c}-{i}",
                           "max_tokens": 16, "temperature": 0}).encode()

    clients = []
    for _ in range(conns):
        t = _ClientTransport(loop)
        p = plane.protocol()
        p.connection_made(t)
        clients.append((t, p))

    async def drive(c: int, n: int) -> None:
        t, p = clients[c]
        for i in range(n):
            b = body(i, c)
            t.waiter = loop.create_future()
            p.data_received(REQUEST % (len(b), b))
            await t.waiter

    async def batch(n: int) -> None:
        await asyncio.gather(*(drive(c, n // conns) for c in range(conns)))

    await batch(2000)  # warm-up: caches, first-time paths
    if parts:
        out = _parts(plane, body(7, 0))
        await proxy.stop()
        return out
    counts: dict[str, float] = {}
    if count:
        counts = await _count(loop, batch, 1000 * conns)
    prof = None
    if profile:
        import cProfile
        prof = cProfile.Profile()
        prof.enable()
    c0 = time.process_time()
    await batch(requests)
    cpu = time.process_time() - c0
    if prof is not None:
        prof.disable()
        prof.dump_stats(profile)  # type: ignore[arg-type]  # only set with a path
    await proxy.stop()
    return {"us_per_request": cpu / requests * 1e6, **counts}


def _parts(plane: Any, body: bytes) -> dict[str, float]:
    """µs per call of each step of one request, on the serving proxy's own objects (timeit, best of 5):
    the function-by-function breakdown of what the whole request costs."""
    import timeit

    from proxy.dataplane.openai import InboundRequest, parse_json
    from proxy.core.request import summary_from_openai
    from proxy.upstream.headers import upstream_request_head
    from proxy.wire.http1 import RequestParser, ResponseParser

    pipeline = plane.pipeline
    router = pipeline.router
    raw = REQUEST % (len(body), body)
    req_parsed = RequestParser().feed(raw)[0]
    headers = tuple(req_parsed.headers)
    parsed = parse_json(body)
    summary = summary_from_openai("/v1/completions", parsed, adapters=router.adapter_names())
    observability = pipeline.observability

    def request_parse() -> None:
        RequestParser(max_head=16384).feed(raw)

    def json_parse() -> None:
        parse_json(body)

    def summarise() -> None:
        summary_from_openai("/v1/completions", parse_json(body), adapters=router.adapter_names())

    def route() -> None:
        lease = router.route(summary, received_at=0.0)
        lease.try_pick()
        lease.status = 200
        lease.finish()

    def head_out() -> None:
        upstream_request_head("POST", "/v1/completions", b"127.0.0.1:1", headers, "127.0.0.1", "http",
                              "0123456789abcdef0123456789abcdef", len(body))

    def response_parse() -> None:
        ResponseParser().feed(ANSWER)

    def observe() -> None:
        ob = observability.begin("0123456789abcdef0123456789abcdef", "http/1.1", "POST", "/v1/completions",
                                 "127.0.0.1", lambda name: None, 0.0, len(body), None)
        ob.summarised(summary)
        r = ob.record
        r.backend, r.policy, r.reason, r.load_score, r.inflight, r.attempts = "be0", "round_robin", "balanced", 0.0, 1, 1
        ob.first_byte()
        r.status, r.bytes_out = 200, len(ANSWER_BODY)
        ob.finish(200, bytes_out=len(ANSWER_BODY))

    steps = {"request_parse": request_parse, "json_parse": json_parse, "summarise(json+summary)": summarise,
             "route(pick+finish)": route, "upstream_head": head_out, "response_parse": response_parse}
    if observability is not None:
        steps["observability(begin..finish, access log)"] = observe
    out = {}
    for name, fn in steps.items():
        n = 20000
        out[name] = min(timeit.repeat(fn, number=n, repeat=5)) / n * 1e6
    return out


async def _count(loop: asyncio.AbstractEventLoop, batch: Any, n: int) -> dict[str, float]:
    """Callbacks scheduled (call_soon: each a loop-turn's worth of work), tasks and futures per request."""
    calls = {"call_soon": 0, "create_task": 0, "create_future": 0}
    orig = {k: getattr(loop, k) for k in calls}

    def wrap(name: str) -> Any:
        def f(*a: Any, **kw: Any) -> Any:
            calls[name] += 1
            return orig[name](*a, **kw)
        return f

    for k in calls:
        setattr(loop, k, wrap(k))
    try:
        await batch(n)
    finally:
        for k in calls:
            if k in vars(loop):
                delattr(loop, k)
    # The driver's own: one create_future per request; the fake backend one call_soon per request.
    return {f"{k}_per_request": v / n for k, v in calls.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", default="round_robin")
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--conns", type=int, default=8)
    ap.add_argument("--profile", default=None)
    ap.add_argument("--count", action="store_true")
    ap.add_argument("--parts", action="store_true", help="µs per call of each step (see _parts)")
    ap.add_argument("--ab", default=None, help="a baseline source tree: alternate rounds, this tree vs it")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--without", action="append", default=[], choices=WITHOUT,
                    help="run without this piece (repeatable): what it costs in situ")
    ap.add_argument("--headers", choices=sorted(HEADS), default="wrk",
                    help="the request head: wrk's 3 fields (as bench_peers sends) or the OpenAI Python SDK's 16")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    global REQUEST
    REQUEST = HEADS[args.headers]
    if args.ab is None:
        fd = os.open(os.devnull, os.O_WRONLY)
        out = os.dup(1)
        os.dup2(fd, 1)  # the access log goes to stdout
        import uvloop
        res = uvloop.run(_run(args.policy, args.requests, args.conns, args.profile, args.count, args.parts,
                              tuple(args.without)))
        os.dup2(out, 1)
        print(json.dumps(res) if args.json else res)
        return
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    base = os.path.abspath(args.ab)
    if not os.path.isfile(os.path.join(base, "proxy", "app.py")):
        # PYTHONPATH naming a folder without the package would fall through to the installed (editable) tree:
        # this tree against itself, silently.
        raise SystemExit(f"--ab {args.ab}: no source tree there (expected {os.path.join(base, 'proxy', 'app.py')})")
    trees = {"base": base, "this": here}
    res: dict[str, list[float]] = {n: [] for n in trees}
    for r in range(args.rounds):
        for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
            out = subprocess.run(
                [sys.executable, "-P", os.path.abspath(__file__), "--policy", args.policy, "--requests",
                 str(args.requests), "--conns", str(args.conns), "--headers", args.headers, "--json",
                 *(f"--without={w}" for w in args.without)],
                env=dict(os.environ, PYTHONPATH=trees[name]), capture_output=True, text=True, check=True).stdout
            res[name].append(json.loads(out.strip().splitlines()[-1])["us_per_request"])
            print(f"round {r} {name}: {res[name][-1]:.2f} µs/request", file=sys.stderr)
    ratios = [t / b for t, b in zip(res["this"], res["base"])]
    print(f"{args.policy}: baseline {statistics.median(res['base']):.2f} µs, this {statistics.median(res['this']):.2f} µs, "
          f"median per-round ratio {statistics.median(ratios):.3f}, this lower in {sum(x < 1 for x in ratios)}/{len(ratios)}")


if __name__ == "__main__":
    main()
