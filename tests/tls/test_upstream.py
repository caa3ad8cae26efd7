"""Upstream TLS: simulated backends behind TLS (sim --tls-cert/--tls-key), the proxy verifying them."""

from __future__ import annotations

from typing import AsyncIterator

import grpc
import httpx
import openai
import pytest
import trustme

from proxy.core.snapshot import Health
from proxy.protos import generate_pb2 as gen
from sim.fleet import Fleet, start_fleet
from tests.grpc import stubs
from tests.support import until
from tests.tls.conftest import Pki, ProxyFactory


@pytest.fixture
async def tls_fleet(pki: Pki) -> AsyncIterator[Fleet]:
    fleet = await start_fleet(2, grpc_port=0, speed=200.0, tls_cert=str(pki.cert_file), tls_key=str(pki.key_file))
    yield fleet
    await fleet.stop()


def _backends(fleet: Fleet, ca_file: object, grpc: bool = False) -> str:
    out = ["backends:"]
    for s in fleet.servers:
        out.append(f"  - name: {s.name}\n    url: '{s.url}'\n    tls: {{ca_file: '{ca_file}'}}")
        if grpc:
            out.append(f"    grpc: '{s.grpc_address}'")
    return "\n".join(out) + "\n"


async def test_https_backends_verified_with_the_ca_and_connections_reused(
        pki: Pki, tls_fleet: Fleet, make_proxy: ProxyFactory) -> None:
    assert all(s.url.startswith("https://") for s in tls_fleet.servers)
    proxy = await make_proxy("listen: {port: 0}\nrouting: {policy: round_robin}\n" + _backends(tls_fleet, pki.ca_file))
    async with httpx.AsyncClient() as http:
        client = openai.AsyncOpenAI(base_url=proxy.http_url + "/v1", api_key="x", http_client=http)
        model = (await client.models.list()).data[0].id
        for _ in range(6):
            done = await client.completions.create(model=model, prompt="a b c", max_tokens=3)
            assert done.choices[0].text
        stream = await client.completions.create(model=model, prompt="a b c", max_tokens=5, stream=True)
        assert len([c async for c in stream if c.choices and c.choices[0].text]) >= 1
    counters = proxy.metrics.upstream
    assert counters.requests >= 7
    assert counters.new_connections <= 2 * len(tls_fleet.servers)  # kept: a handshake per connection, not per request


async def test_grpcs_backends_behind_h2c_on_the_main_port(pki: Pki, tls_fleet: Fleet,
                                                          make_proxy: ProxyFactory) -> None:
    assert all((s.grpc_address or "").startswith("grpcs://") for s in tls_fleet.servers)
    proxy = await make_proxy("listen: {port: 0}\n" + _backends(tls_fleet, pki.ca_file, grpc=True))
    port = proxy.http_url.rsplit(":", 1)[1]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:  # h2c prior knowledge, the main port
        reply = await stubs.generate(ch)(gen.GenerateRequest(prompt="a b c", max_tokens=3, ignore_eos=True),
                                         timeout=10)
    assert reply.text


async def test_backend_with_a_certificate_from_another_ca_fails_clearly_and_is_ejected(
        pki: Pki, tls_fleet: Fleet, make_proxy: ProxyFactory, caplog: pytest.LogCaptureFixture) -> None:
    stranger = trustme.CA()
    other_ca = pki.dir / "other-ca.pem"
    stranger.cert_pem.write_to_path(str(other_ca))
    bad, good = tls_fleet.servers
    text = ("listen: {port: 0}\nrouting: {policy: round_robin}\n"
            "outlier_detection: {consecutive_connect_failures: 2, base_ejection_ms: 60000}\n"
            f"backends:\n  - name: bad\n    url: '{bad.url}'\n    tls: {{ca_file: '{other_ca}'}}\n"
            f"  - name: good\n    url: '{good.url}'\n    tls: {{ca_file: '{pki.ca_file}'}}\n")
    proxy = await make_proxy(text)
    body = {"model": good.backend.engine.model_name, "prompt": "hi", "max_tokens": 2}

    def failures() -> int:
        return sum("TLS handshake with 127.0.0.1:" in m and "certificate verify failed: unable to get local "
                   "issuer certificate" in m for m in caplog.messages)

    async with httpx.AsyncClient() as http:
        for _ in range(6):  # each one failing on `bad` is retried on `good`: the client never sees it
            r = await http.post(proxy.http_url + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
        assert failures() == 2  # the clear reason, logged, for each of the two handshakes that were tried
        assert proxy.store.current.get("bad").health is Health.UNHEALTHY  # type: ignore[union-attr]
        for _ in range(6):  # ejected: no handshake is tried against it again until the ejection ends
            r = await http.post(proxy.http_url + "/v1/completions", json=body)
            assert r.status_code == 200
        assert failures() == 2


async def test_health_checks_and_metric_scrapes_over_tls(pki: Pki, tls_fleet: Fleet, make_proxy: ProxyFactory) -> None:
    from proxy.app import AffinityProxy
    from proxy.config import parse_config

    metrics = "".join(f"\n    metrics_url: '{s.url}/metrics'" for s in tls_fleet.servers[:1])
    backends = _backends(tls_fleet, pki.ca_file).replace(f"url: '{tls_fleet.servers[0].url}'",
                                                         f"url: '{tls_fleet.servers[0].url}'{metrics}", 1)
    proxy = AffinityProxy(parse_config(
        "listen: {port: 0}\nadmin: {port: 0}\n"
        "health_checks: {interval_ms: 50, healthy_threshold: 1}\n"
        "telemetry: {enabled: true, interval_ms: 50, timeout_ms: 40}\n" + backends))
    await proxy.start()
    try:
        await until(lambda: all(b.health is Health.HEALTHY for b in proxy.store.current.backends), timeout=10)
        assert proxy.resilience.checker.handshakes_s, "the TLS handshakes of the checks were timed"
        assert proxy.telemetry is not None
        await until(lambda: proxy.telemetry.rounds >= 2 and proxy.store.current.get(  # type: ignore[union-attr]
            tls_fleet.servers[0].name).signals is not None, timeout=10)
    finally:
        await proxy.stop()


async def test_client_certificate_and_server_name_override(pki: Pki, make_proxy: ProxyFactory) -> None:
    """A backend behind mTLS whose certificate names only `backend.internal`, reached by IP address."""
    import ssl

    from aiohttp import web

    cert, key = pki.issue("backend", "backend.internal")
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(pki.ca_file))
    server_ctx.load_cert_chain(str(cert), str(key))
    server_ctx.verify_mode = ssl.CERT_REQUIRED
    seen: list[object] = []

    async def answer(request: web.Request) -> web.Response:
        sslobj = request.transport.get_extra_info("ssl_object") if request.transport else None  # type: ignore[union-attr]
        seen.append(sslobj.getpeercert() if sslobj is not None else None)
        return web.json_response({"path": request.path})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_ctx)
    await site.start()
    try:
        port = runner.addresses[0][1]
        client_cert, client_key = pki.issue("proxy-client", "proxy.internal")
        proxy = await make_proxy(
            "listen: {port: 0}\nbackends:\n  - name: mtls\n"
            f"    url: 'https://127.0.0.1:{port}'\n"
            f"    tls: {{ca_file: '{pki.ca_file}', server_name: backend.internal, cert_file: '{client_cert}', "
            f"key_file: '{client_key}'}}\n")
        async with httpx.AsyncClient() as http:
            r = await http.post(proxy.http_url + "/v1/completions", json={"model": "m", "prompt": "x"})
            assert r.status_code == 200, r.text
            r = await http.get(proxy.http_url + "/v1/models")  # the proxy's own session: the same context
            assert r.status_code == 200
        assert len(seen) == 2, seen  # both reached it: the relay pool and the proxy's own session
        assert all(peer is not None for peer in seen)  # with the proxy's client certificate
    finally:
        await runner.cleanup()
