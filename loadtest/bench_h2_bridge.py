"""The HTTP/2 bridge's own CPU per request, in one process, without sockets: where h2c A/B rounds on a busy
machine cannot separate a few microseconds, this can.

A real client-facing `Downstream` (proxy/grpc/downstream.py) on uvloop, with a fake transport, is fed the
bytes an h2 client connection produces for small POSTs (HEADERS + one DATA frame with END_STREAM, `--batch`
requests per read, as h2load -m4 sends them); the OpenAI pipeline is replaced by a stub that answers every
request at once with the fake backend's JSON answer (the bridge, the header conversions, the task, the h2
state machine, HPACK both ways and the frames are what is measured; routing and the upstream leg are not).
The client's windows are open wide and its requests encoded before the clock starts; it reads
every answer after the clock stops (the round fails unless every request was answered).

    .venv/bin/python -m loadtest.bench_h2_bridge --requests 20000 --rounds 5
    PYTHONPATH=/work/wt/before-h2 .venv/bin/python -P loadtest/bench_h2_bridge.py   # another tree

It runs the bridge's Python source (AFFINITY_PROXY_NATIVE=0, set below before the proxy is imported): its
stand-ins (a namespace for the listener's context, a stub pipeline) and its ablations (replacing attributes
of a connection) are refused by the compiled modules (proxy/native), which check types and fix methods.
The compiled build's h2c cost is bench_peers.py's h2c row.

Prints the thread CPU µs per request of the proxy side for each round, and their median. `--ablate encoder`
(`decoder`, `headers`, `fast`, `whole`, or several joined by +) adds alternating rounds with h2's or hpack's own
way put back on the connection for that piece (this tree only, see `_ablate`), and the median of the
per-round ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import types
from typing import Any

os.environ["AFFINITY_PROXY_NATIVE"] = "0"  # the Python source (see the docstring), before proxy is imported

import h2.config
import h2.connection
import h2.events
import h2.settings
import hpack
from multidict import CIMultiDict

BODY = (b'{"model":"fake-model","prompt":"System prompt 1: You are a helpful assistant. ' + b"a" * 150 +
        b' user question 0-1","max_tokens":16,"temperature":0}')
ANSWER = b'{"id":"cmpl-1","object":"text_completion","model":"fake-model","choices":[{"text":"' + b"x" * 150 + b'"}]}'


class FakeTransport:
    def __init__(self) -> None:
        self.out: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.out.append(data)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 40000) if name == "peername" else default

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass


class StubPipeline:
    """Answers at once, as the OpenAI pipeline does with a backend's JSON answer."""

    max_body_bytes = 1 << 20
    session_header = None
    observability = None

    async def handle(self, req: Any, responder: Any) -> None:
        from proxy.dataplane.openai import Answer

        headers: CIMultiDict[str] = CIMultiDict([("Server", "fake-backend"), ("Content-Type", "application/json"),
                                                 ("x-request-id", req.request_id)])
        await responder.send(Answer(200, "OK", headers, ANSWER))


def client_conn() -> h2.connection.H2Connection:
    conn = h2.connection.H2Connection(h2.config.H2Configuration(
        client_side=True, header_encoding=None, validate_inbound_headers=False, validate_outbound_headers=False,
        normalize_inbound_headers=False, normalize_outbound_headers=False))
    conn.initiate_connection()
    return conn


async def one_round(n: int, batch: int, without: frozenset[str] = frozenset()) -> float:
    from proxy.grpc.connection import Flusher
    from proxy.grpc.downstream import Downstream
    from proxy.grpc.grpc_config import GrpcOptions

    loop = asyncio.get_running_loop()
    ctx = types.SimpleNamespace(flusher=Flusher(loop), options=GrpcOptions(), downstreams=set(),
                                openai=StubPipeline(), registry=None, local_prefixes=(), observability=None)
    down = Downstream(ctx)  # type: ignore[arg-type]  # a stand-in context: only what the bridge path reads
    _ablate(down, without)
    transport = FakeTransport()
    down.connection_made(transport)  # type: ignore[arg-type]
    client = client_conn()
    # The client's windows are opened wide at once, so the requests can all be encoded before the clock
    # starts and the answers read after it stops.
    client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 2**31 - 1})
    client.increment_flow_control_window(2**31 - 1 - 65535)
    # As nghttp2 (h2load, curl) sends them: :path and content-length not indexed.
    headers = [(b":method", b"POST"), hpack.NeverIndexedHeaderTuple(b":path", b"/v1/completions"),
               (b":scheme", b"http"), (b":authority", b"127.0.0.1:8000"), (b"user-agent", b"h2load nghttp2/1.52.0"),
               (b"content-type", b"application/json"),
               hpack.NeverIndexedHeaderTuple(b"content-length", str(len(BODY)).encode())]
    down.data_received(client.data_to_send())  # the prefaces and SETTINGS both ways
    await asyncio.sleep(0)
    client.receive_data(b"".join(transport.out))
    transport.out.clear()
    clock = time.thread_time
    spent = 0.0
    sid = 1
    done = answered = 0
    while done < n:  # chunks within the 1,024 streams the proxy allows; the client reads between them
        reads = [client.data_to_send()]
        for _ in range(0, min(n - done, 900), batch):
            for _ in range(batch):
                client.send_headers(sid, headers)
                client.send_data(sid, BODY, end_stream=True)
                sid += 2
                done += 1
            reads.append(client.data_to_send())
        t0 = clock()
        for data in reads:
            down.data_received(data)
            for _ in range(4):  # the requests' tasks, their answers, the flusher
                await asyncio.sleep(0)
        spent += clock() - t0
        for ev in client.receive_data(b"".join(transport.out)):
            if isinstance(ev, h2.events.StreamEnded):
                answered += 1
        transport.out.clear()
    if answered != done:
        raise SystemExit(f"{done} requests sent, {answered} answered")
    down.connection_lost(None)
    return spent / done * 1e6


def _ablate(down: Any, without: frozenset[str]) -> None:
    """Put h2's and hpack's own ways back on the connection, to measure what this tree's save: `encoder`,
    `decoder` (hpack's coders), `headers` (new streams' HEADERS through h2's frame buffer), `fast` (every
    frame through h2's receive_data), `whole` (whole answers through h2's send_headers + send_data)."""
    if "fast" in without:  # every receive fast path (DATA, WINDOW_UPDATE, new-stream HEADERS)
        down.fast = False
    if "headers" in without:
        down.fast_headers = False
    if "whole" in without:
        down.send_whole = lambda sid, headers, body: False
    if "encoder" in without:
        from proxy.grpc.connection import PerCallEncoder

        down.conn.encoder = PerCallEncoder()
    if "decoder" in without:
        decoder = hpack.Decoder()
        decoder.max_header_list_size = down.conn.decoder.max_header_list_size
        decoder.max_allowed_table_size = down.conn.decoder.max_allowed_table_size
        down.conn.decoder = decoder


async def main_async(args: argparse.Namespace) -> None:
    from proxy.grpc.connection import quiet_hpack_logging

    quiet_hpack_logging()  # as the listener does at start
    variants = {"this": frozenset[str]()}
    for v in args.ablate:
        variants["without " + v] = frozenset(v.split("+"))
    await one_round(2000, args.batch)  # warm-up
    res: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(args.rounds):
        for name, without in (list(variants.items()) if r % 2 == 0 else list(variants.items())[::-1]):
            res[name].append(await one_round(args.requests, args.batch, without))
            print(f"round {r} {name}: {res[name][-1]:.2f} µs CPU per request (proxy side)")
    for name, xs in res.items():
        ratio = ""
        if name != "this":
            ratio = f", this / {name}: median of per-round ratios " + \
                f"{statistics.median(a / b for a, b in zip(res['this'], xs)):.3f}"
        print(f"median {name}: {statistics.median(xs):.2f} µs{ratio}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=3, help="requests per read")
    ap.add_argument("--ablate", action="append", default=[], metavar="encoder|decoder|headers|fast|whole|a+b",
                    help="also run rounds (alternating) with h2's / hpack's own ways back (see _ablate)")
    args = ap.parse_args()
    import uvloop

    uvloop.run(main_async(args))


if __name__ == "__main__":
    main()
