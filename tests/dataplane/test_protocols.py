"""The same request over HTTP/1.1, HTTP/2 (the bridge on the h2c listener) and gRPC lives one life: the
same metric series, a duration counted from the moment its head arrived, unique request ids, and the same
400 for JSON nested too deep."""

from __future__ import annotations

import asyncio
import json
from typing import Awaitable, Callable

import aiohttp
import grpc
import httpx
from prometheus_client.parser import text_string_to_metric_families

from proxy.app import AffinityProxy
from proxy.protos import generate_pb2 as gen
from sim.fleet import Fleet
from tests.grpc import stubs
from tests.grpc.rawh2 import RawClient, grpc_frame

PAUSE_S = 0.3  # between a request's head and its body

Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def _series(proxy: AffinityProxy) -> Series:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{proxy.admin_url}/metrics") as resp:
            text = await resp.text()
    out: Series = {}
    for family in text_string_to_metric_families(text):
        if family.name in ("affinity_proxy_requests", "affinity_proxy_routing_decisions",
                           "affinity_proxy_errors", "affinity_proxy_request_duration_seconds"):
            for s in family.samples:
                if not s.name.endswith("_created"):
                    out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def _delta(proxy: AffinityProxy, send: Callable[[], Awaitable[None]]) -> Series:
    before = await _series(proxy)
    await send()
    after = await _series(proxy)
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def _model(fleet: Fleet) -> str:
    return fleet.servers[0].backend.engine.model_name


def _http_address(proxy: AffinityProxy) -> tuple[str, int]:
    host, port = proxy.http_url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


async def _http1_paused(proxy: AffinityProxy, body: bytes) -> int:
    """HTTP/1.1 by hand: the head, a pause, then the body; returns the status."""
    host, port = _http_address(proxy)
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode())
    await writer.drain()
    await asyncio.sleep(PAUSE_S)
    writer.write(body)
    await writer.drain()
    answer = await reader.read()
    writer.close()
    return int(answer.split(b" ", 2)[1])


async def test_one_request_three_protocols_same_series_same_duration_semantics(
        fleet: Fleet, proxy: AffinityProxy) -> None:
    model = _model(fleet)
    prompt = "The same request over every protocol."
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 4, "ignore_eos": True}).encode()
    assert proxy.grpc is not None
    grpc_address = f"127.0.0.1:{proxy.grpc.port}"

    async def http1() -> None:
        assert await _http1_paused(proxy, body) == 200

    async def http2() -> None:
        async def paused_body():  # type: ignore[no-untyped-def]
            await asyncio.sleep(PAUSE_S)  # httpx has sent the HEADERS frame by now
            yield body

        async with httpx.AsyncClient(http1=False, http2=True, base_url=f"http://{grpc_address}", timeout=10) as c:
            resp = await c.post("/v1/completions", content=paused_body(), headers={"content-type": "application/json"})
            assert resp.http_version == "HTTP/2" and resp.status_code == 200, resp.text

    async def grpc_raw() -> None:
        # The HEADERS, a pause, then the message: the proxy holds the call until it can route it.
        message = gen.GenerateRequest(model=model, prompt=prompt, max_tokens=4).SerializeToString()
        client = await RawClient.connect(grpc_address)
        try:
            sid = client.call("/affinity.v1.Generation/Generate", None, end=False)
            await asyncio.sleep(PAUSE_S)
            client.conn.send_data(sid, grpc_frame(message), end_stream=True)
            client.flush()
            assert (await client.status(sid))[0] == 0
        finally:
            client.close()

    async def grpcio() -> None:
        async with grpc.aio.insecure_channel(grpc_address) as ch:
            reply = await stubs.generate(ch)(gen.GenerateRequest(model=model, prompt=prompt, max_tokens=4),
                                             timeout=10)
            assert reply.text

    deltas = {name: await _delta(proxy, send)
              for name, send in (("http/1.1", http1), ("http/2", http2), ("grpc", grpc_raw), ("grpcio", grpcio))}
    backend = fleet.servers[0].name

    def shape(d: Series) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        # Everything but the duration's sum and buckets, which depend on how long each took.
        return {k: v for k, v in d.items()
                if not k[0].endswith(("_sum", "_bucket"))}

    expected = shape(deltas["http/1.1"])
    assert expected[("affinity_proxy_requests_total", (("backend", backend), ("status", "200")))] == 1
    assert expected[("affinity_proxy_request_duration_seconds_count", (("backend", backend),))] == 1
    assert sum(v for k, v in expected.items() if k[0] == "affinity_proxy_routing_decisions_total") == 1
    for name, d in deltas.items():
        assert shape(d) == expected, name
    # Every protocol counts its duration from the request's head: the pause before the body is inside it.
    for name in ("http/1.1", "http/2", "grpc"):
        took = deltas[name][("affinity_proxy_request_duration_seconds_sum", (("backend", backend),))]
        assert PAUSE_S * 0.9 <= took < 10, (name, took)


async def test_request_ids_over_fresh_http2_connections_are_distinct(proxy: AffinityProxy) -> None:
    assert proxy.grpc is not None
    base = f"http://127.0.0.1:{proxy.grpc.port}"
    ids: list[str] = []

    async def connection(n: int) -> None:
        async with httpx.AsyncClient(http1=False, http2=True, base_url=base, timeout=30) as client:
            for _ in range(n):
                resp = await client.get("/v1/models")
                assert resp.http_version == "HTTP/2" and resp.status_code == 200
                ids.append(resp.headers["x-request-id"])

    per = [1000 // 30 + (1 if i < 1000 % 30 else 0) for i in range(30)]
    for start in range(0, 30, 10):  # ten connections at a time, each fresh
        await asyncio.gather(*(connection(n) for n in per[start:start + 10]))
    assert len(ids) == 1000 and len(set(ids)) == 1000


async def test_deeply_nested_json_is_a_400_on_both_http_paths(fleet: Fleet, proxy: AffinityProxy) -> None:
    assert proxy.grpc is not None
    for depth in (200, 10_000):
        body = (b'{"model": "' + _model(fleet).encode() + b'", "messages": ' + b"[" * depth + b"]" * depth + b"}")
        async with httpx.AsyncClient(base_url=proxy.http_url, timeout=10) as h1, \
                httpx.AsyncClient(http1=False, http2=True, base_url=f"http://127.0.0.1:{proxy.grpc.port}",
                                  timeout=10) as h2:
            for client in (h1, h2):
                resp = await client.post("/v1/chat/completions", content=body,
                                         headers={"content-type": "application/json"})
                assert resp.status_code == 400, (client, depth, resp.text)
                error = resp.json()["error"]
                assert error["type"] == "invalid_request_error" and error["code"] == "invalid_json"
                assert "nested deeper than" in error["message"]
                assert resp.headers["x-request-id"]
