"""Plain HTTP/2 requests on the gRPC listener (httpx with http2=True) take the HTTP/1.1 requests' upstream
path: the relay pool, ORCA load reports, and retries on another backend before the first byte."""

from __future__ import annotations

import socket

import httpx

from sim.fleet import Fleet
from tests.grpc.conftest import fleet_entries, proxy_address


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _chat(fleet: Fleet, text: str) -> dict[str, object]:
    return {"model": fleet.servers[0].backend.engine.model_name, "max_tokens": 3, "ignore_eos": True,
            "messages": [{"role": "user", "content": text}]}


async def test_bridge_uses_the_relay_pool_and_folds_in_orca_reports(fleet: Fleet, make_proxy) -> None:
    proxy = await make_proxy(fleet_entries(fleet)[:1])
    reports: list[tuple[str, str]] = []
    assert proxy.http is not None and proxy.upstream is not None
    # telemetry.orca's hook, read by the shared OpenAI pipeline on every response
    proxy.openai.load_report = lambda backend, report: reports.append((backend, report))
    requests_before = proxy.metrics.upstream.requests
    async with httpx.AsyncClient(http1=False, http2=True, base_url=f"http://{proxy_address(proxy)}",
                                 timeout=10) as client:
        for i in range(2):
            resp = await client.post("/v1/chat/completions", json=_chat(fleet, f"orca {i}"))
            assert resp.http_version == "HTTP/2" and resp.status_code == 200, resp.text
            assert resp.json()["usage"]["completion_tokens"] == 3
            # The report the proxy asked for stops at the proxy.
            assert "endpoint-load-metrics" not in resp.headers
            assert resp.headers["x-request-id"]
    assert [b for b, _ in reports] == ["sim-0", "sim-0"]
    assert all("kv_cache_usage_perc" in r for _, r in reports)
    # Both went through the data plane's pool, over one kept-alive connection.
    assert proxy.metrics.upstream.requests == requests_before + 2
    assert proxy.upstream.idle_connections(fleet.servers[0].url) == 1


async def test_bridge_retries_a_dead_backend_before_the_first_byte(fleet: Fleet, make_proxy) -> None:
    dead = ("dead", f"http://127.0.0.1:{_closed_port()}", None)
    proxy = await make_proxy([dead, *fleet_entries(fleet)[:1]])  # round robin: every other pick is the dead one
    async with httpx.AsyncClient(http1=False, http2=True, base_url=f"http://{proxy_address(proxy)}",
                                 timeout=10) as client:
        for i in range(4):
            resp = await client.post("/v1/chat/completions", json=_chat(fleet, f"retry {i}"))
            assert resp.status_code == 200, resp.text
            stream_text = []
            async with client.stream("POST", "/v1/chat/completions",
                                     json={**_chat(fleet, f"stream {i}"), "stream": True}) as stream:
                assert stream.status_code == 200
                async for line in stream.aiter_lines():
                    stream_text.append(line)
            assert "data: [DONE]" in stream_text
    # Every answer was a 200: the dead backend's attempts went to the live one (until outlier detection,
    # fed by those connect failures, ejected the dead one).
    assert proxy.resilience.retries.retried >= 1


async def test_bridge_head_keeps_the_length_and_unrouted_paths_pass(fleet: Fleet, make_proxy) -> None:
    proxy = await make_proxy(fleet_entries(fleet)[:1])
    async with httpx.AsyncClient(http1=False, http2=True, base_url=f"http://{proxy_address(proxy)}",
                                 timeout=10) as client:
        got = await client.get("/v1/models")
        assert got.status_code == 200 and got.json()["data"]
        head = await client.head("/v1/models")
        assert head.status_code == 200 and head.content == b""
        assert head.headers.get("content-length") == got.headers["content-length"]
