"""Traces of gRPC calls through the real proxy: a server span per call with the rpc.* attributes, the routing
span, one client span per attempt (a connect failure retried elsewhere shows as two), and the backend
receives the last attempt's span as its parent in the client's trace (the client's own traceparent is not
forwarded). Spans go to an in-memory exporter, one at a time."""

from __future__ import annotations

from typing import AsyncIterator

import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from proxy.app import AffinityProxy
from proxy.config import parse_config
from proxy.observability.config import TracingConfig
from proxy.observability.tracing import Tracing
from proxy.protos import generate_pb2 as gen
from tests.grpc.echo import EchoBackend
from tests.support import free_port

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


@pytest.fixture
async def echo() -> AsyncIterator[EchoBackend]:
    b = EchoBackend("echo-0")
    await b.start()
    yield b
    await b.stop()


async def test_a_retried_grpc_call_is_one_trace_with_an_upstream_span_per_attempt(echo: EchoBackend) -> None:
    dead = f"127.0.0.1:{free_port()}"  # nothing listens: the first attempt there fails to connect
    exporter = InMemorySpanExporter()
    tracing = Tracing(TracingConfig(enabled=True, sampler="parent_based", ratio=0.0), exporter, batch=False)
    proxy = AffinityProxy(parse_config(
        "listen: {port: 0}\ngrpc_listen: {port: 0}\nadmin: {port: 0}\n"
        "telemetry: {enabled: false}\nhealth_checks: {enabled: false}\noutlier_detection: {enabled: false}\n"
        "logging: {access_log: {enabled: false}}\nrouting: {policy: round_robin}\n"
        "backends:\n"
        f"  - {{name: dead, url: 'http://127.0.0.1:9', grpc: '{dead}'}}\n"
        f"  - {{name: echo-0, url: 'http://127.0.0.1:10', grpc: '{echo.address}'}}\n", "<test>"),
        tracing=tracing)
    await proxy.start()
    try:
        assert proxy.grpc is not None
        async with grpc.aio.insecure_channel(f"127.0.0.1:{proxy.grpc.port}") as ch:
            call = ch.unary_unary("/affinity.v1.Generation/Generate",
                                  request_serializer=gen.GenerateRequest.SerializeToString,
                                  response_deserializer=gen.GenerateResponse.FromString)
            for i in range(2):  # round robin: one of the two calls tries the dead backend first
                await call(gen.GenerateRequest(model="m", prompt=f"hello {i}", max_tokens=1), timeout=10,
                           metadata=(("traceparent", f"00-{TRACE_ID}-{CLIENT_SPAN}-01"), ("tracestate", "k=v")))
    finally:
        await proxy.stop()
    spans = exporter.get_finished_spans()
    servers = [s for s in spans if s.kind == SpanKind.SERVER]
    assert len(servers) == 2 and all(f"{s.context.trace_id:032x}" == TRACE_ID for s in spans)
    for server in servers:
        assert server.name == "/affinity.v1.Generation/Generate" and f"{server.parent.span_id:016x}" == CLIENT_SPAN
        attrs = server.attributes
        assert (attrs["rpc.system"], attrs["rpc.service"], attrs["rpc.method"]) == ("grpc", "affinity.v1.Generation",
                                                                                   "Generate")
        assert attrs["rpc.grpc.status_code"] == 0 and attrs["affinity.backend"] == "echo-0"
        assert attrs["gen_ai.request.model"] == "m" and server.status.status_code != StatusCode.ERROR
    retried = next(s for s in servers if s.attributes["affinity.attempts"] == 2)
    children = sorted((s for s in spans if s.parent is not None and s.parent.span_id == retried.context.span_id),
                      key=lambda s: s.start_time)
    assert [s.name for s in children] == ["route", "upstream dead", "route", "upstream echo-0"]
    first, second = children[1], children[3]
    assert first.kind == second.kind == SpanKind.CLIENT
    assert (first.attributes["affinity.attempt"], second.attributes["affinity.attempt"]) == (1, 2)
    assert first.status.status_code == StatusCode.ERROR and first.attributes["rpc.grpc.status_code"] == 14
    assert second.attributes["rpc.grpc.status_code"] == 0 and second.status.status_code != StatusCode.ERROR
    assert [e.name for e in second.events] == ["first_byte"]
    assert children[2].attributes["affinity.backend"] == "echo-0" and children[0].attributes["affinity.backend"] == "dead"
    # The backend saw the answering attempt's span as its parent, and never the client's own span.
    parents = [dict(md).get("traceparent") for md in echo.received_metadata]
    assert f"00-{TRACE_ID}-{second.context.span_id:016x}-01" in parents
    assert all(p is not None and CLIENT_SPAN not in p for p in parents)
    assert all(dict(md).get("tracestate") == "k=v" for md in echo.received_metadata)
