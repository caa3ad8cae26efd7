"""Micro-benchmark: the shared sans-I/O parser against the two parsers it replaced, on the same inputs.

    .venv/bin/python -m tests.wire.bench_http1 [--old-rev 327c407] [--rounds 5]

The old code is loaded from git (`git show REV:path`), so both sides run in one process on the same
interpreter. Each case drives the real consumer objects without sockets, the way their protocol callbacks
would: the relay pool's `Exchange` (a fresh one per response, as per request) and the scrape client's
`_Conn`. Cases:
  json    a ~300-byte JSON answer with Content-Length, the whole response in one read (the pool's fast path)
  sse     a chunked SSE stream of 50 events, one chunk per read, relayed as raw chunks (`relay_chunks`)
  sse-dec the same stream decoded (`stream()`-style pieces, as the HTTP/2 bridge reads it)
  scrape  a ~4 KB Prometheus text answer with Content-Length in one read (the scrape client)
Rounds alternate old and new so that load on the machine hits both alike; the ratio new/old per round
is printed with the range over rounds (below 1.0: the new code is cheaper). Not collected by pytest.

`--e2e` measures instead the CPU time (process_time, so the backend's own work is not counted) of the
proxy's process per request through the real relay pool, old and new, over loopback to a backend in a
subprocess: the parser's share of a real exchange (event loop, socket reads and writes included).
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import timeit
import types
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]


def load_old(rev: str, path: str, name: str) -> types.ModuleType:
    src = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True).stdout
    mod = types.ModuleType(name)
    mod.__file__ = f"{rev}:{path}"
    sys.modules[name] = mod  # dataclass/annotation machinery looks modules up by name
    exec(compile(src, mod.__file__, "exec"), mod.__dict__)
    return mod


JSON_BODY = (b'{"id":"cmpl-8f2a","object":"text_completion","created":1733040000,"model":"llama-3-8b",'
             b'"choices":[{"index":0,"text":" The capital of France is Paris.","logprobs":null,'
             b'"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":8,"total_tokens":20}}')
JSON_RESPONSE = (b"HTTP/1.1 200 OK\r\ndate: Tue, 01 Dec 2026 09:00:00 GMT\r\nserver: uvicorn\r\n"
                 b"content-length: %d\r\ncontent-type: application/json\r\n\r\n%s" % (len(JSON_BODY), JSON_BODY))
SSE_HEAD = (b"HTTP/1.1 200 OK\r\ndate: Tue, 01 Dec 2026 09:00:00 GMT\r\nserver: uvicorn\r\n"
            b"content-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n")
_EVENT = (b'data: {"id":"cmpl-8f2a","object":"text_completion","created":1733040000,"choices":[{"index":0,'
          b'"text":" word%02d","logprobs":null,"finish_reason":null}],"model":"llama-3-8b"}\n\n')
SSE_READS = [b"%x\r\n%s\r\n" % (len(_EVENT % i), _EVENT % i) for i in range(50)] + [b"0\r\n\r\n"]
METRICS = b"".join(b'vllm:num_requests_running{model_name="m",engine="%d"} %d.0\n' % (i, i) for i in range(60))
SCRAPE_RESPONSE = (b"HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: %d\r\n\r\n%s"
                   % (len(METRICS), METRICS))


class FakeTransport:
    def __init__(self) -> None:
        self.n = 0

    def write(self, data: bytes) -> None:
        self.n += len(data)

    def is_closing(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return 0

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass


class FakeConn:
    transport = FakeTransport()
    closed = False

    def close(self) -> None:
        pass


def pool_cases(mod: Any, loop: asyncio.AbstractEventLoop) -> dict[str, Callable[[], None]]:
    Exchange = mod.Exchange
    conn = FakeConn()
    sink = FakeTransport()

    def json() -> None:
        ex = Exchange(conn, False, loop)
        ex.feed(JSON_RESPONSE)
        assert ex._complete and ex._parts == [JSON_BODY]

    def sse() -> None:
        ex = Exchange(conn, False, loop)
        ex.feed(SSE_HEAD)
        ex.relay_chunks(sink)
        for data in SSE_READS:
            ex.feed(data)
        assert ex._complete

    def sse_dec() -> None:
        ex = Exchange(conn, False, loop)
        ex.feed(SSE_HEAD)
        for data in SSE_READS:
            ex.feed(data)
        assert ex._complete and len(ex._parts) == 50

    return {"json": json, "sse": sse, "sse-dec": sse_dec}


def scrape_case(mod: Any, loop: asyncio.AbstractEventLoop) -> Callable[[], None]:
    conn = mod._Conn()
    conn.connection_made(FakeTransport())
    get = b"GET /metrics HTTP/1.1\r\nHost: b\r\n\r\n"

    def scrape() -> None:
        waiter = conn.request(get)  # needs a running loop for its future: main() marks `loop` as running
        conn.data_received(SCRAPE_RESPONSE)
        assert waiter.result() == METRICS

    return scrape


BACKEND = r"""
import asyncio, sys
JSON_RESPONSE, SSE_HEAD, SSE_READS = eval(sys.stdin.read())

async def serve(r, w):
    try:
        while True:
            head = await r.readuntil(b"\r\n\r\n")
            n = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            await r.readexactly(n)
            if head.startswith(b"POST /sse"):
                w.write(SSE_HEAD)
                for piece in SSE_READS:
                    w.write(piece)
                    await w.drain()
                    await asyncio.sleep(0)
            else:
                w.write(JSON_RESPONSE)
    except (asyncio.IncompleteReadError, ConnectionError):
        pass

async def main():
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


async def e2e_round(pool_mod: Any, url: str, case: str, n: int) -> float:
    import time

    from proxy.metrics import UpstreamCounters

    pool = pool_mod.UpstreamPool(UpstreamCounters(), connections_per_backend=1, keepalive_s=60.0,
                                 connect_timeout_s=5.0, request_timeout_s=30.0)
    head = b"POST /%s HTTP/1.1\r\nHost: b\r\nContent-Length: 2\r\n\r\n" % case.encode()
    sink = FakeTransport()

    async def one() -> None:
        ex = await pool.request(url, head, b"{}")
        try:
            if ex.chunked:
                ex.relay_chunks(sink)
                while not ex.complete:
                    await ex.wait_relay()
            else:
                await ex.read()
        finally:
            ex.release()

    await one()  # connect and warm
    t0 = time.process_time()
    for _ in range(n):
        await one()
    spent = time.process_time() - t0
    await pool.close()
    return spent / n * 1e6


def e2e(args: argparse.Namespace, old_pool: Any, new_pool: Any) -> None:
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    backend = subprocess.Popen([sys.executable, "-c", BACKEND], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert backend.stdin is not None and backend.stdout is not None
    backend.stdin.write(repr((JSON_RESPONSE, SSE_HEAD, SSE_READS)).encode())
    backend.stdin.close()
    url = f"http://127.0.0.1:{int(backend.stdout.readline())}"
    try:
        ratios: dict[str, list[float]] = {"json": [], "sse": []}
        print("CPU time of the proxy's side per request")
        print(f"{'round':>5} {'case':>8} {'old us':>9} {'new us':>9} {'new/old':>8}")
        for r in range(args.rounds):
            for case in ratios:
                n = args.number // 20 if case == "sse" else args.number // 2
                sides = [("old", old_pool), ("new", new_pool)]
                if r % 2:
                    sides.reverse()
                t = {side: asyncio.run(e2e_round(mod, url, case, n)) for side, mod in sides}
                ratios[case].append(t["new"] / t["old"])
                print(f"{r:>5} {case:>8} {t['old']:>9.1f} {t['new']:>9.1f} {t['new'] / t['old']:>8.2f}")
        print("\nnew/old per case over rounds: min .. max (median)")
        for case, rs in ratios.items():
            rs.sort()
            print(f"  {case:>8}: {rs[0]:.2f} .. {rs[-1]:.2f} ({rs[len(rs) // 2]:.2f})")
    finally:
        backend.kill()
        backend.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old-rev", default="327c407", help="the commit holding the parsers that were replaced")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--number", type=int, default=2000, help="calls per timing (sse: /10)")
    ap.add_argument("--e2e", action="store_true", help="CPU per request through the real pool over loopback")
    args = ap.parse_args()

    import proxy.control.httpget as new_httpget
    import proxy.upstream.http1 as new_pool

    old_pool = load_old(args.old_rev, "proxy/upstream/http1.py", "_old_upstream_http1")
    old_httpget = load_old(args.old_rev, "proxy/control/httpget.py", "_old_control_httpget")
    if args.e2e:
        e2e(args, old_pool, new_pool)
        return
    loop = asyncio.new_event_loop()
    asyncio.events._set_running_loop(loop)  # the scrape client's request() asks for the running loop
    old = pool_cases(old_pool, loop) | {"scrape": scrape_case(old_httpget, loop)}
    new = pool_cases(new_pool, loop) | {"scrape": scrape_case(new_httpget, loop)}

    ratios: dict[str, list[float]] = {k: [] for k in old}
    print(f"{'round':>5} {'case':>8} {'old us':>9} {'new us':>9} {'new/old':>8}")
    for r in range(args.rounds):
        for case in old:
            n = args.number // 10 if case.startswith("sse") else args.number
            pair = [(old[case], "old"), (new[case], "new")]
            if r % 2:
                pair.reverse()  # alternate which side runs first
            t: dict[str, float] = {}
            for fn, side in pair:
                fn()  # warm
                t[side] = min(timeit.repeat(fn, number=n, repeat=3)) / n * 1e6
            ratios[case].append(t["new"] / t["old"])
            print(f"{r:>5} {case:>8} {t['old']:>9.2f} {t['new']:>9.2f} {t['new'] / t['old']:>8.2f}")
    print("\nnew/old per case over rounds: min .. max (median)")
    for case, rs in ratios.items():
        rs.sort()
        print(f"  {case:>8}: {rs[0]:.2f} .. {rs[-1]:.2f} ({rs[len(rs) // 2]:.2f})")
    asyncio.events._set_running_loop(None)
    loop.close()


if __name__ == "__main__":
    main()
