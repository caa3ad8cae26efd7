"""The HTTP data plane against scriptable fake backends, driven by the real `openai` client and aiohttp."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import openai
import pytest
from yarl import URL

from proxy.app import AffinityProxy
from proxy.config import parse_config
from tests.http.conftest import QUIET, ProxyFactory
from tests.support import FakeBackend, until

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


def client(proxy: object, **kw: object) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=proxy.http_url + "/v1", api_key="sk-test", max_retries=0, **kw)  # type: ignore[attr-defined]


async def test_openai_client_non_streaming_and_streaming(backends: list[FakeBackend], make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(backends)
    async with client(proxy) as c:
        answer = await c.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}])
        assert answer.choices[0].message.content in ("hello from b0", "hello from b1")
        stream = await c.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "hi"}], stream=True)
        text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream])
        assert text == "t0 t1 t2 "
        completion = await c.completions.create(model="fake-model", prompt="once upon", stream=True)
        assert "".join([ch.choices[0].text async for ch in completion]) == "t0 t1 t2 "
    # round robin spread the three requests over both backends
    assert {len(b.seen) for b in backends} == {1, 2}


async def test_body_forwarded_byte_for_byte(backends: list[FakeBackend], make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(backends[:1])
    raw = b'{ "model":"fake-model",\n  "messages": [{"role":"user","content":"caf\\u00e9 \xc3\xa9"}], "extra": 1.50 }'
    async with aiohttp.ClientSession() as s:
        async with s.post(proxy.http_url + "/v1/chat/completions", data=raw,
                          headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 200
    assert backends[0].seen[-1].body == raw


async def test_headers_rewritten(backends: list[FakeBackend], make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(backends[:1], extra="debug_headers: true\n")
    async with aiohttp.ClientSession() as s:
        async with s.post(
            proxy.http_url + "/v1/chat/completions?x=1", json=CHAT,
            headers={"Authorization": "Bearer sk-secret", "Connection": "keep-alive, X-Private",
                     "X-Private": "drop me", "Keep-Alive": "timeout=5", "Proxy-Authorization": "Basic x",
                     "X-Forwarded-For": "10.1.1.1", "X-Custom": "kept"},
        ) as resp:
            assert resp.status == 200
            request_id = resp.headers["x-request-id"]
            assert len(request_id) >= 16
            assert resp.headers["x-affinity-backend"] == "b0"
        async with s.post(proxy.http_url + "/v1/chat/completions", json=CHAT,
                          headers={"x-request-id": "my-id-42"}) as resp:
            assert resp.headers["x-request-id"] == "my-id-42"
    first, second = backends[0].seen
    h = {k.lower(): v for k, v in first.headers.items()}
    assert first.path_qs == "/v1/chat/completions?x=1"
    assert h["authorization"] == "Bearer sk-secret"
    assert h["x-custom"] == "kept"
    assert h["x-forwarded-for"] == "10.1.1.1, 127.0.0.1"
    assert h["x-forwarded-proto"] == "http"
    assert h["x-request-id"] == request_id
    for hop in ("x-private", "keep-alive", "proxy-authorization"):
        assert hop not in h
    assert second.headers.get("X-Request-ID") == "my-id-42"


async def _post(url: str, data: bytes | None = None, **kw: object) -> tuple[int, Any, Any]:
    async with aiohttp.ClientSession() as s:
        async with s.post(url, data=data, **kw) as resp:  # type: ignore[arg-type]
            return resp.status, resp.headers.copy(), json.loads(await resp.read())


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        (b"{not json", "invalid_json", None),
        (b"[1, 2]", "invalid_value", None),
        (b'{"model": "fake-model", "messages": "hi"}', "invalid_value", "messages"),
        (b'{"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}',
         "invalid_value", "stream"),
    ],
)
async def test_malformed_bodies_are_400(
    backends: list[FakeBackend], make_proxy: ProxyFactory, body: bytes, code: str, param: str | None
) -> None:
    proxy = await make_proxy(backends[:1])
    status, headers, err = await _post(proxy.http_url + "/v1/chat/completions", body)
    assert status == 400 and headers["x-request-id"]
    assert err["error"]["code"] == code
    assert err["error"]["type"] == "invalid_request_error"
    assert err["error"]["param"] == param
    assert backends[0].seen == []


async def test_body_too_large_is_413(backends: list[FakeBackend], make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(backends[:1], extra="limits: {max_body_bytes: 1000}\n")
    big = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * 2000}]}).encode()
    status, _, err = await _post(proxy.http_url + "/v1/chat/completions", big)
    assert status == 413 and err["error"]["code"] == "body_too_large"

    async def chunked() -> object:
        for _ in range(4):
            yield b"x" * 400

    status, _, err = await _post(proxy.http_url + "/v1/chat/completions", chunked())  # type: ignore[arg-type]
    assert status == 413
    assert backends[0].seen == []


async def test_headers_too_large_is_431(backends: list[FakeBackend], make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(backends[:1], extra="limits: {max_header_bytes: 2048}\n")
    status, _, err = await _post(proxy.http_url + "/v1/chat/completions", json.dumps(CHAT).encode(),
                                 headers={"X-Big": "y" * 3000})
    assert status == 431 and err["error"]["code"] == "headers_too_large"
    # a single line beyond aiohttp's own parser limit is answered 431 as well, still OpenAI-shaped
    status, _, err = await _post(proxy.http_url + "/v1/chat/completions", json.dumps(CHAT).encode(),
                                 headers={"X-Huge": "z" * 20000})
    assert status == 431 and err["error"]["code"] == "headers_too_large"
    assert backends[0].seen == []


async def test_unknown_model_is_404(backends: list[FakeBackend], make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(backends, backend_extra=", models: [fake-model]")
    async with client(proxy) as c:
        with pytest.raises(openai.NotFoundError) as info:
            await c.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert info.value.code == "model_not_found"
    assert all(b.seen == [] for b in backends)


async def test_model_routes_only_to_backends_serving_it(backends: list[FakeBackend]) -> None:
    lines = [f"  - {{name: {b.name}, url: '{b.url}', models: [m{i}]}}" for i, b in enumerate(backends)]
    proxy = AffinityProxy(parse_config(QUIET + "routing: {policy: round_robin}\nbackends:\n" + "\n".join(lines)))
    await proxy.start()
    try:
        for _ in range(4):
            status, _, _ = await _post(proxy.http_url + "/v1/chat/completions",
                                       json.dumps({**CHAT, "model": "m1"}).encode())
            assert status == 200
        assert len(backends[0].seen) == 0 and len(backends[1].seen) == 4
        async with aiohttp.ClientSession() as s:
            async with s.get(proxy.http_url + "/v1/models") as resp:
                ids = sorted(m["id"] for m in (await resp.json())["data"])
        assert ids == ["m0", "m1"]
    finally:
        await proxy.stop()


async def test_no_backend_is_503_with_retry_after(make_proxy: ProxyFactory) -> None:
    # A config without backends is refused; a fleet with none routable (weight 0) is the same case at run time.
    idle = FakeBackend("idle")
    await idle.start()
    try:
        proxy = await make_proxy([idle], backend_extra=", weight: 0")
        status, headers, err = await _post(proxy.http_url + "/v1/chat/completions", json.dumps(CHAT).encode())
    finally:
        await idle.stop()
    assert status == 503 and headers["Retry-After"] == "1"
    assert err["error"]["code"] == "no_backend"


async def test_backend_unreachable_is_502(make_proxy: ProxyFactory) -> None:
    dead = FakeBackend("dead")
    await dead.start()
    await dead.stop()  # the port is now closed
    proxy = await make_proxy([dead])
    status, headers, err = await _post(proxy.http_url + "/v1/chat/completions", json.dumps(CHAT).encode())
    assert status == 502 and err["error"]["code"] == "upstream_error" and "x-request-id" in headers


async def test_models_lists_models_of_healthy_backends(backends: list[FakeBackend], make_proxy: ProxyFactory) -> None:
    backends[0].models = ["alpha", "shared"]
    backends[1].models = ["beta", "shared"]
    proxy = await make_proxy(backends)
    async with client(proxy) as c:
        assert sorted([m.id async for m in c.models.list()]) == ["alpha", "beta", "shared"]
    # a backend marked unhealthy drops out of the list
    from proxy.core.snapshot import Health

    proxy.store.update(lambda s: s.replace_backend("b1", health=Health.UNHEALTHY))
    async with client(proxy) as c:
        assert sorted([m.id async for m in c.models.list()]) == ["alpha", "shared"]


async def test_other_paths_forwarded_unchanged(backends: list[FakeBackend], make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(backends[:1])
    async with aiohttp.ClientSession() as s:
        async with s.get(URL(proxy.http_url + "/health?deep=1&x=%2F", encoded=True)) as resp:
            assert resp.status == 200
            assert (await resp.json())["path"] == "/health?deep=1&x=%2F"
    assert backends[0].seen[-1].method == "GET"


async def test_client_disconnect_cancels_upstream(backends: list[FakeBackend], make_proxy: ProxyFactory) -> None:
    backends[0].hang_stream = True
    proxy = await make_proxy(backends[:1])
    async with aiohttp.ClientSession() as s:
        resp = await s.post(proxy.http_url + "/v1/chat/completions", json={**CHAT, "stream": True})
        first = await resp.content.readline()
        assert first.startswith(b"data: ")
        assert proxy.inflight.total_requests == 1
        resp.close()  # drop the connection mid-stream
    await asyncio.wait_for(backends[0].cancelled.wait(), 10)
    await until(lambda: proxy.inflight.total_requests == 0, timeout=5, message="nothing in flight")


async def test_backend_dying_mid_stream_gives_clean_error(backends: list[FakeBackend], make_proxy: ProxyFactory) -> None:
    backends[0].events = 10
    backends[0].die_after_events = 2
    proxy = await make_proxy(backends[:1])
    got: list[str] = []
    async with client(proxy) as c:
        stream = await c.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "hi"}], stream=True)
        with pytest.raises(openai.APIError) as info:
            async for chunk in stream:
                got.append(chunk.choices[0].delta.content or "")
    assert got == ["t0 ", "t1 "]
    assert "failed while streaming" in info.value.message
    # the raw stream ends with one OpenAI-shaped error event and a clean chunked close
    async with aiohttp.ClientSession() as s:
        async with s.post(proxy.http_url + "/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
            raw = await resp.read()
    events = [e for e in raw.split(b"\n\n") if e.strip()]
    assert json.loads(events[-1].removeprefix(b"data: "))["error"]["code"] == "upstream_stream_error"


async def test_backend_error_status_passed_through(backends: list[FakeBackend], make_proxy: ProxyFactory) -> None:
    backends[0].status = 429
    proxy = await make_proxy(backends[:1])
    status, _, err = await _post(proxy.http_url + "/v1/chat/completions", json.dumps(CHAT).encode())
    assert status == 429 and err["error"]["message"] == "backend says no"


async def test_admin_and_metrics(backends: list[FakeBackend], make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(backends)
    async with client(proxy) as c:
        for _ in range(6):
            await c.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}])
    async with aiohttp.ClientSession() as s:
        async with s.get(proxy.admin_url + "/admin/backends") as resp:
            snap = await resp.json()
        async with s.get(proxy.admin_url + "/metrics") as resp:
            text = await resp.text()
    assert snap["version"] >= 1 and [b["name"] for b in snap["backends"]] == ["b0", "b1"]  # telemetry publishes
    assert all(b["inflight_requests"] == 0 for b in snap["backends"])
    metrics = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line and line[0] != "#"}
    assert metrics['affinity_proxy_requests_total{backend="b0",status="200"}'] == 3
    assert metrics['affinity_proxy_routing_decisions_total{policy="round_robin",reason="balanced"}'] == 6
    assert metrics["affinity_proxy_upstream_requests"] == 6
    # keep-alive: at most one new connection per backend for six sequential requests
    assert metrics["affinity_proxy_upstream_connections_opened"] <= 2
    assert metrics["affinity_proxy_upstream_connection_reuse_ratio"] >= 4 / 6


async def test_per_backend_and_total_inflight_limits(backends: list[FakeBackend], make_proxy: ProxyFactory) -> None:
    for b in backends:
        b.hang_stream = True
    proxy = await make_proxy(backends, backend_extra=", max_inflight: 1", policy="round_robin",
                             extra="overload: {reject_status: 503}\n")
    async with aiohttp.ClientSession() as s:
        held = [await s.post(proxy.http_url + "/v1/chat/completions", json={**CHAT, "stream": True}) for _ in range(2)]
        for r in held:
            await r.content.readline()
        assert {b.name: proxy.inflight.requests(b.name) for b in backends} == {"b0": 1, "b1": 1}
        async with s.post(proxy.http_url + "/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 503 and resp.headers["Retry-After"] == "1"
            assert (await resp.json())["error"]["code"] == "overloaded"
        for r in held:
            r.close()


async def test_expect_100_continue_is_answered(backends: list[FakeBackend], make_proxy: ProxyFactory) -> None:
    """curl sends `Expect: 100-continue` for bodies over 1 KiB and holds the body back until told to go on."""
    proxy = await make_proxy(backends[:1])
    body = json.dumps({**CHAT, "messages": [{"role": "user", "content": "y" * 3000}]}).encode()
    port = int(proxy.http_url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body))
    interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert interim.startswith(b"HTTP/1.1 100")
    writer.write(body)
    final = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert final.startswith(b"HTTP/1.1 200")
    writer.close()
    assert backends[0].seen[-1].body == body
    assert "expect" not in {k.lower() for k in backends[0].seen[-1].headers}


async def test_slow_client_backpressures_the_backend(backends: list[FakeBackend], make_proxy: ProxyFactory) -> None:
    """A client that stops reading must stop the backend too (bounded buffering), and lose nothing."""
    fake = backends[0]
    fake.events, fake.pad = 300, 65536  # ~20 MB in all, far more than socket buffers + the relay's mark
    proxy = await make_proxy([fake])
    port = int(proxy.http_url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=2**20)
    body = json.dumps({**CHAT, "stream": True}).encode()
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    transport = writer.transport
    transport.pause_reading()  # a client that stops reading
    previous = -1
    while fake.written != previous:  # wait until the backend is stuck
        previous = fake.written
        await asyncio.sleep(0.3)
    assert fake.written < fake.events
    transport.resume_reading()
    data = bytearray()
    while not (data.endswith(b"0\r\n\r\n") and b"data: [DONE]" in data[-64:]):
        piece = await asyncio.wait_for(reader.read(2**20), 60)
        assert piece, "the proxy closed the stream early"
        data += piece
    writer.close()
    assert data.count(b'"content": "t') == fake.events
    assert fake.written == fake.events


async def _orca_proxy(fake: FakeBackend, more_yaml: str = "") -> AffinityProxy:
    """A started proxy with `telemetry.orca` on (plus `more_yaml`) in front of `fake`, which answers every
    request with an ORCA report."""
    fake.response_headers = {"endpoint-load-metrics": "TEXT named_metrics.kv_cache_usage_perc=0.4"}
    text = ("listen: {port: 0}\nadmin: {port: 0}\nhealth_checks: {enabled: false}\n"
            "telemetry: {enabled: true, orca: true}\nrouting: {policy: round_robin}\n" + more_yaml +
            f"backends:\n  - {{name: {fake.name}, url: '{fake.url}'}}\n")
    proxy = AffinityProxy(parse_config(text))
    await proxy.start()
    return proxy


async def test_orca_report_the_proxy_asked_for_stops_at_the_proxy(backends: list[FakeBackend]) -> None:
    """telemetry.orca makes the proxy ask backends for `endpoint-load-metrics`: that report is the proxy's,
    so the client gets it only when it asked for one itself."""
    fake = backends[0]
    proxy = await _orca_proxy(fake)
    url = proxy.http_url + "/v1/chat/completions"
    try:
        async with aiohttp.ClientSession() as s:
            for body in (CHAT, {**CHAT, "stream": True}):
                async with s.post(url, json=body) as resp:
                    assert resp.status == 200
                    await resp.read()
                    assert "endpoint-load-metrics" not in resp.headers
                    assert "x-request-id" in resp.headers
                seen = [h for h in fake.seen if h.method == "POST"][-1]
                assert seen.headers["endpoint-load-metrics-format"] == "TEXT"
            async with s.post(url, json=CHAT, headers={"endpoint-load-metrics-format": "TEXT"}) as resp:
                assert resp.headers["endpoint-load-metrics"] == "TEXT named_metrics.kv_cache_usage_perc=0.4"
        reports = proxy.metrics.registry.get_sample_value("affinity_proxy_telemetry_orca_reports_total")
        assert reports == 3  # every report still refreshed the backend's signals
    finally:
        await proxy.stop()


async def test_a_client_that_asked_for_the_orca_report_gets_it_with_tracing_on(backends: list[FakeBackend]) -> None:
    """With tracing on the backend request carries the proxy's trace context as well: the report the client
    asked for is still the client's (it was once dropped whenever the proxy added any header of its own)."""
    proxy = await _orca_proxy(backends[0], "tracing: {enabled: true, sampler: always_off}\n")
    url = proxy.http_url + "/v1/chat/completions"
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(url, json=CHAT, headers={"endpoint-load-metrics-format": "TEXT"}) as resp:
                assert resp.status == 200
                assert resp.headers["endpoint-load-metrics"] == "TEXT named_metrics.kv_cache_usage_perc=0.4"
            async with s.post(url, json=CHAT) as resp:
                assert resp.status == 200
                assert "endpoint-load-metrics" not in resp.headers  # the proxy's own ask still stops here
    finally:
        await proxy.stop()
