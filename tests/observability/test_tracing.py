"""Tracing with an in-memory exporter, and once through a real OTLP/HTTP export to an in-process receiver."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from proxy.config import ConfigError, parse_config
from proxy.observability.config import TracingConfig
from proxy.observability.tracing import Tracing, build_tracing

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


def tracing(**kw) -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    return Tracing(TracingConfig(enabled=True, **kw), exporter, batch=False), exporter


def one_request(t: Tracing, headers: dict, attempts: int = 1, protocol: str = "http/1.1",
                path: str = "/v1/chat/completions") -> tuple[list[dict], object]:
    req = t.start(headers, f"POST {path}", protocol, "POST", path, client="10.1.2.3:5555", model="llama",
                  session="s-1")
    req.routed("affinity", "prefix_hit", "gpu-1", alternates=("gpu-2", "gpu-0"), prefix_blocks_matched=7,
               load_score=0.42)
    sent = []
    for n in range(1, attempts + 1):
        backend_headers = {"content-type": "application/json"}
        att = req.attempt("gpu-1" if n == 1 else "gpu-2", "http://10.0.0.7:8000", n, backend_headers)
        sent.append(backend_headers)
        if n < attempts:
            att.finish(error="connect_refused")
        else:
            att.first_byte()
            att.finish(status=200)
    req.event("first_token")
    req.finish(200, attempts=attempts)
    return sent, req


def test_client_trace_is_continued_and_the_backend_gets_the_upstream_span_as_parent():
    t, exp = tracing()
    sent, req = one_request(t, {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01", "tracestate": "vendor=x"}, attempts=2)
    spans = {s.name: s for s in exp.get_finished_spans()}
    assert set(spans) == {"POST /v1/chat/completions", "route", "upstream gpu-1", "upstream gpu-2"}
    server = spans["POST /v1/chat/completions"]
    assert f"{server.context.trace_id:032x}" == TRACE_ID == req.trace_id
    assert f"{server.parent.span_id:016x}" == CLIENT_SPAN and server.kind == SpanKind.SERVER
    assert server.attributes["http.request.method"] == "POST" and server.attributes["url.path"] == "/v1/chat/completions"
    assert server.attributes["client.address"] == "10.1.2.3" and server.attributes["gen_ai.request.model"] == "llama"
    assert server.attributes["affinity.backend"] == "gpu-1" and server.attributes["affinity.attempts"] == 2
    assert server.attributes["http.response.status_code"] == 200
    assert [e.name for e in server.events] == ["first_token", "end"]
    route = spans["route"]
    assert route.parent.span_id == server.context.span_id
    assert dict(route.attributes) == {"affinity.policy": "affinity", "affinity.reason": "prefix_hit",
                                      "affinity.backend": "gpu-1", "affinity.alternates": ("gpu-2", "gpu-0"),
                                      "affinity.prefix_blocks_matched": 7, "affinity.load_score": 0.42}
    first, second = spans["upstream gpu-1"], spans["upstream gpu-2"]
    assert first.kind == second.kind == SpanKind.CLIENT
    assert first.parent.span_id == second.parent.span_id == server.context.span_id
    assert (first.attributes["affinity.attempt"], second.attributes["affinity.attempt"]) == (1, 2)
    assert first.status.status_code == StatusCode.ERROR and first.attributes["error.type"] == "connect_refused"
    assert second.attributes["server.address"] == "10.0.0.7" and second.attributes["server.port"] == 8000
    assert [e.name for e in second.events] == ["first_byte"]
    for headers, span in zip(sent, (first, second)):  # each attempt carries its own span as the parent
        assert headers["traceparent"] == f"00-{TRACE_ID}-{span.context.span_id:016x}-01"
        assert headers["tracestate"] == "vendor=x"


def test_grpc_call_attributes():
    t, exp = tracing(sampler="always_on")
    one_request(t, {}, protocol="grpc", path="/affinity.v1.Generation/Generate")
    server = next(s for s in exp.get_finished_spans() if s.kind == SpanKind.SERVER)
    assert server.attributes["rpc.system"] == "grpc" and server.attributes["rpc.service"] == "affinity.v1.Generation"
    assert server.attributes["rpc.method"] == "Generate"


def test_grpc_server_error_marks_the_span_failed():
    t, exp = tracing(sampler="always_on")
    req = t.start({}, "POST /x.Y/Z", "grpc", "POST", "/x.Y/Z")
    req.finish(200, grpc_status=14, error=None)
    (span,) = exp.get_finished_spans()
    assert span.status.status_code == StatusCode.ERROR and span.attributes["rpc.grpc.status_code"] == 14


def test_default_sampler_ratio_holds_over_2000_untraced_requests():
    t, exp = tracing()  # parent_based, ratio 0.1
    reqs = [t.start({}, "POST /v1/completions", "http/1.1", "POST", "/v1/completions") for _ in range(2000)]
    for r in reqs:
        r.finish(200)
    sampled = sum(r.sampled for r in reqs)
    assert len(exp.get_finished_spans()) == sampled
    assert abs(sampled / 2000 - 0.1) <= 0.03
    assert all(len(r.trace_id) == 32 and r.trace_id != "0" * 32 for r in reqs)  # for the access log even unsampled


def test_parent_based_follows_the_clients_sampled_flag():
    t, exp = tracing(ratio=0.0)
    sent, req = one_request(t, {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"})
    assert req.sampled and len(exp.get_finished_spans()) == 3  # server, route, upstream
    t, exp = tracing(ratio=1.0)
    sent, req = one_request(t, {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-00"})
    assert not req.sampled and exp.get_finished_spans() == ()
    assert sent[0]["traceparent"].startswith(f"00-{TRACE_ID}-") and sent[0]["traceparent"].endswith("-00")
    t, exp = tracing(sampler="ratio", ratio=1.0)  # ignores the parent's flag
    one_request(t, {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-00"})
    assert len(exp.get_finished_spans()) == 3


def test_off_means_nothing_built_and_config_parses():
    assert build_tracing(TracingConfig()) is None
    cfg = parse_config("backends: [{name: b0, url: 'http://127.0.0.1:9'}]\ntracing: {enabled: true, ratio: 0.25, endpoint: 'http://otel:4318/v1/traces'}\n")
    assert cfg.tracing.enabled and cfg.tracing.ratio == 0.25 and cfg.tracing.sampler == "parent_based"
    with pytest.raises(ConfigError, match="tracing.endpoint"):
        parse_config("backends: [{name: b0, url: 'http://127.0.0.1:9'}]\ntracing: {endpoint: 'otel:4318'}\n")
    with pytest.raises(ConfigError, match="tracing.sampler"):
        parse_config("backends: [{name: b0, url: 'http://127.0.0.1:9'}]\ntracing: {sampler: parent}\n")


async def test_otlp_http_export_reaches_a_receiver(aiohttp_server):
    received: list[ExportTraceServiceRequest] = []

    async def traces(request: web.Request) -> web.Response:
        msg = ExportTraceServiceRequest()
        msg.ParseFromString(await request.read())
        received.append(msg)
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    server = await aiohttp_server(app, host="127.0.0.1")
    t = build_tracing(TracingConfig(enabled=True, sampler="always_on", batch_delay_ms=50,
                                    endpoint=f"http://127.0.0.1:{server.port}/v1/traces", service_name="proxy-test"))
    assert t is not None
    try:
        one_request(t, {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"})
        assert await asyncio.to_thread(t.force_flush, 10_000)  # the exporter thread posts to this loop
    finally:
        await asyncio.to_thread(t.shutdown)
    spans = [s for m in received for rs in m.resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert {s.name for s in spans} == {"POST /v1/chat/completions", "route", "upstream gpu-1"}
    assert all(s.trace_id.hex() == TRACE_ID for s in spans)
    service = [a.value.string_value for m in received for rs in m.resource_spans for a in rs.resource.attributes
               if a.key == "service.name"]
    assert service and set(service) == {"proxy-test"}
