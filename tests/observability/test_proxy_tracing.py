"""Traces through the real proxy, against the simulator, exported over OTLP/HTTP to an in-process receiver.

A client sends a streamed chat with its own `traceparent`; the receiver (decoding the protobuf export with
opentelemetry-proto) must find the server, routing and upstream spans in the client's trace with their
attributes, and the backend (a recording tap in front of the simulated server) must receive a
`traceparent` whose parent is the upstream span, never the client's own copy. Then 2,000 untraced
requests: the default sampler (parent_based, ratio 0.1) keeps 10% of them (within 3 points).
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span as PbSpan

from proxy.app import AffinityProxy
from proxy.config import parse_config
from sim.fleet import Fleet, start_fleet
from tests.support import until

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


class Receiver:
    """An OTLP/HTTP traces endpoint on 127.0.0.1 that keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[PbSpan] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def _traces(self, request: web.Request) -> web.Response:
        msg = ExportTraceServiceRequest()
        msg.ParseFromString(await request.read())
        self.spans.extend(s for rs in msg.resource_spans for ss in rs.scope_spans for s in ss.spans)
        return web.Response(body=b"", content_type="application/x-protobuf")

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/traces", self._traces)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = self.runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}/v1/traces"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


class Tap:
    """In front of one simulated server: records each request's headers, forwards it, streams the answer."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.seen: list[dict[str, str]] = []
        self.runner: web.AppRunner | None = None
        self.url = ""
        self.session: aiohttp.ClientSession | None = None

    async def _any(self, request: web.Request) -> web.StreamResponse:
        self.seen.append({k.lower(): v for k, v in request.headers.items()})
        assert self.session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        async with self.session.request(request.method, self.target + request.path_qs, headers=headers,
                                        data=await request.read()) as up:
            resp = web.StreamResponse(status=up.status, headers={
                k: v for k, v in up.headers.items() if k.lower() not in ("content-length", "transfer-encoding")})
            await resp.prepare(request)
            async for piece in up.content.iter_any():
                await resp.write(piece)
            await resp.write_eof()
            return resp

    async def start(self) -> None:
        self.session = aiohttp.ClientSession()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._any)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        if self.session is not None:
            await self.session.close()


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    f = await start_fleet(2, host="127.0.0.1", port=0, speed=50.0)
    yield f
    await f.stop()


def _attrs(span: PbSpan) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in span.attributes:
        v = kv.value
        kind = v.WhichOneof("value")
        if kind == "array_value":
            out[kv.key] = [x.string_value for x in v.array_value.values]
        else:
            out[kv.key] = getattr(v, kind)
    return out


async def test_a_clients_streamed_chat_is_one_trace_through_the_proxy_to_the_backend(fleet: Fleet) -> None:
    receiver = Receiver()
    await receiver.start()
    taps = [Tap(s.url) for s in fleet.servers]
    for t in taps:
        await t.start()
    backends = "\n".join(f"  - {{name: {s.name}, url: '{t.url}'}}" for s, t in zip(fleet.servers, taps))
    config = parse_config(
        "listen: {port: 0}\nadmin: {port: 0}\nhealth_checks: {enabled: false}\n"
        "telemetry: {enabled: true, interval_ms: 100, timeout_ms: 90}\n"
        "logging: {access_log: {enabled: false}}\n"
        f"tracing: {{enabled: true, endpoint: '{receiver.url}', batch_delay_ms: 100}}\n"
        f"routing: {{policy: affinity}}\nbackends:\n{backends}\n", "<test>")
    proxy = AffinityProxy(config)
    await proxy.start()
    try:
        # The routing span carries the load score: wait until the poller has scored every backend.
        await until(lambda: all(b.load_score is not None for b in proxy.store.current.backends), timeout=20)
        model = fleet.servers[0].backend.engine.model_name
        body = {"model": model, "stream": True, "max_tokens": 6,
                "messages": [{"role": "user", "content": "trace me through the proxy " * 20}]}
        client_parent = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
        async with aiohttp.ClientSession() as s:
            async with s.post(proxy.http_url + "/v1/chat/completions", json=body,
                              headers={"traceparent": client_parent, "tracestate": "vendor=x"}) as resp:
                assert resp.status == 200
                text = (await resp.read()).decode()
        assert "[DONE]" in text
        assert proxy.tracing is not None
        assert await asyncio.to_thread(proxy.tracing.force_flush, 10_000)
        ours = await until(lambda: (lambda found: found if len(found) >= 3 else None)(
            [sp for sp in receiver.spans if sp.trace_id.hex() == TRACE_ID]), timeout=10)
        by_name = {sp.name: sp for sp in ours}
        server = by_name["POST /v1/chat/completions"]
        route = by_name["route"]
        (upstream,) = [sp for sp in ours if sp.name.startswith("upstream ")]
        assert server.kind == PbSpan.SPAN_KIND_SERVER and server.parent_span_id.hex() == CLIENT_SPAN
        sattrs = _attrs(server)
        assert sattrs["http.request.method"] == "POST" and sattrs["url.path"] == "/v1/chat/completions"
        assert sattrs["gen_ai.request.model"] == model and sattrs["http.response.status_code"] == 200
        assert sattrs["affinity.attempts"] == 1 and sattrs["client.address"] == "127.0.0.1"
        assert [e.name for e in server.events] == ["first_byte", "end"]
        assert route.parent_span_id == server.span_id and route.kind == PbSpan.SPAN_KIND_INTERNAL
        rattrs = _attrs(route)
        chosen = rattrs["affinity.backend"]
        assert chosen in {s.name for s in fleet.servers} and sattrs["affinity.backend"] == chosen
        assert rattrs["affinity.policy"] == "affinity" and rattrs["affinity.reason"]
        assert isinstance(rattrs["affinity.prefix_blocks_matched"], int)
        assert 0.0 <= rattrs["affinity.load_score"] <= 1.0
        assert rattrs["affinity.alternates"] == [s.name for s in fleet.servers if s.name != chosen]
        assert upstream.kind == PbSpan.SPAN_KIND_CLIENT and upstream.parent_span_id == server.span_id
        uattrs = _attrs(upstream)
        assert upstream.name == f"upstream {chosen}" and uattrs["affinity.attempt"] == 1
        assert uattrs["http.response.status_code"] == 200 and uattrs["server.address"] == "127.0.0.1"
        assert [e.name for e in upstream.events] == ["first_byte"]
        # The backend got the upstream span as its parent, in the client's trace; the client's own copy is gone.
        (tap,) = [t for s, t in zip(fleet.servers, taps) if s.name == chosen]
        (seen,) = [h for h in tap.seen if h.get("traceparent", "").startswith(f"00-{TRACE_ID}-")]
        assert seen["traceparent"] == f"00-{TRACE_ID}-{upstream.span_id.hex()}-01"
        assert seen["tracestate"] == "vendor=x"

        # 2,000 requests without a traceparent: parent_based(TraceIdRatio(0.1)) keeps about 10% of them.
        receiver.spans.clear()
        sem = asyncio.Semaphore(32)
        async with aiohttp.ClientSession() as s:
            async def one(i: int) -> None:
                async with sem:
                    async with s.get(proxy.http_url + "/health") as r:
                        assert r.status == 200
                        await r.read()
            await asyncio.gather(*(one(i) for i in range(2000)))
        assert await asyncio.to_thread(proxy.tracing.force_flush, 30_000)
        servers = [sp for sp in receiver.spans if sp.kind == PbSpan.SPAN_KIND_SERVER]
        assert len({sp.trace_id for sp in servers}) == len(servers)  # one trace per request
        assert abs(len(servers) / 2000 - 0.1) <= 0.03, len(servers)
        # Every sampled request has its routing and upstream span too.
        assert len(receiver.spans) == 3 * len(servers)
    finally:
        await proxy.stop()
        for t in taps:
            await t.stop()
        await receiver.stop()


async def test_tracing_off_builds_nothing_and_forwards_the_clients_traceparent_untouched(fleet: Fleet) -> None:
    tap = Tap(fleet.servers[0].url)
    await tap.start()
    config = parse_config(
        "listen: {port: 0}\nadmin: {port: 0}\nhealth_checks: {enabled: false}\ntelemetry: {enabled: false}\n"
        f"backends:\n  - {{name: b0, url: '{tap.url}'}}\n", "<test>")
    proxy = AffinityProxy(config)
    await proxy.start()
    try:
        assert proxy.tracing is None and proxy.observability.tracing is None
        async with aiohttp.ClientSession() as s:
            async with s.get(proxy.http_url + "/health",
                             headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"}) as r:
                assert r.status == 200
        assert tap.seen[-1]["traceparent"] == f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
    finally:
        await proxy.stop()
        await tap.stop()
