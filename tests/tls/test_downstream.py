"""Downstream TLS and one port for every protocol, with real clients: openai+httpx, httpx h2, curl, grpcio."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import ssl
import subprocess
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from proxy.app import AffinityProxy
from proxy.config import parse_config
from proxy.protos import generate_pb2 as gen
from tests.grpc import stubs
from tests.grpc.echo import EchoBackend
from tests.support import FakeBackend, until
from tests.tls.conftest import Pki, ProxyFactory, backend_line, tls_listen


def _port(proxy: AffinityProxy) -> int:
    return int(proxy.http_url.rsplit(":", 1)[1])


async def test_openai_client_over_tls_plain_and_streaming(pki: Pki, backend: FakeBackend,
                                                          make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(tls_listen(pki) + backend_line(backend.url))
    assert proxy.http_url.startswith("https://127.0.0.1:")
    async with httpx.AsyncClient(verify=pki.client_context()) as http:
        client = openai.AsyncOpenAI(base_url=proxy.http_url + "/v1", api_key="x", http_client=http)
        done = await client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}])
        assert done.choices[0].message.content == "hello from fake"
        stream = await client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "hi"}], stream=True)
        pieces = [c.choices[0].delta.content async for c in stream if c.choices and c.choices[0].delta.content]
        assert len(pieces) == backend.events


async def test_a_client_that_does_not_trust_the_ca_fails_the_handshake(pki: Pki, backend: FakeBackend,
                                                                       make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(tls_listen(pki) + backend_line(backend.url))
    async with httpx.AsyncClient() as http:  # system CAs only
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            await http.get(proxy.http_url + "/v1/models")


async def test_httpx_http2_over_tls_and_http11_share_the_main_port(pki: Pki, backend: FakeBackend,
                                                                   make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(tls_listen(pki) + backend_line(backend.url))
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient(verify=pki.client_context(), http2=True) as h2:
        r = await h2.post(proxy.http_url + "/v1/chat/completions", json=body)
        assert r.http_version == "HTTP/2" and r.status_code == 200
        assert r.json()["choices"][0]["message"]["content"] == "hello from fake"
    async with httpx.AsyncClient(verify=pki.client_context()) as h1:
        r = await h1.post(proxy.http_url + "/v1/chat/completions", json=body)
        assert r.http_version == "HTTP/1.1" and r.status_code == 200


async def test_h2c_prior_knowledge_on_the_plaintext_main_port(backend: FakeBackend, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy("listen: {port: 0}\n" + backend_line(backend.url))
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with httpx.AsyncClient(http1=False, http2=True) as h2c:
        async with h2c.stream("POST", proxy.http_url + "/v1/chat/completions", json=body) as r:
            assert r.http_version == "HTTP/2" and r.status_code == 200
            text = (await r.aread()).decode()
        assert text.count("data: ") == backend.events + 1 and "[DONE]" in text
    async with httpx.AsyncClient() as h1:  # and HTTP/1.1 on the same port still
        r = await h1.get(proxy.http_url + "/v1/models")
        assert r.status_code == 200 and r.http_version == "HTTP/1.1"


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
@pytest.mark.parametrize("version", ["--http1.1", "--http2"])
async def test_curl_with_cacert(pki: Pki, backend: FakeBackend, make_proxy: ProxyFactory, version: str) -> None:
    features = subprocess.run(["curl", "--version"], capture_output=True, text=True).stdout
    if version == "--http2" and "HTTP2" not in features:
        pytest.skip("this curl has no HTTP/2 (no HTTP2 in `curl --version`)")
    proxy = await make_proxy(tls_listen(pki) + backend_line(backend.url))
    body = json.dumps({"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]})
    proc = await asyncio.create_subprocess_exec(
        "curl", "-sS", version, "--cacert", str(pki.ca_file), "-w", "\n%{http_version} %{http_code}",
        "-H", "content-type: application/json", "-d", body, proxy.http_url + "/v1/chat/completions",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err
    answer, status = out.decode().rsplit("\n", 1)
    assert status == ("2 200" if version == "--http2" else "1.1 200")
    assert json.loads(answer)["choices"][0]["message"]["content"] == "hello from fake"


async def test_grpcio_with_tls_on_the_main_port(pki: Pki, make_proxy: ProxyFactory) -> None:
    echo = EchoBackend("echo-0")
    await echo.start()
    try:
        proxy = await make_proxy(tls_listen(pki) + backend_line("http://127.0.0.1:9", "echo-0", echo.address))
        creds = grpc.ssl_channel_credentials(root_certificates=pki.ca_file.read_bytes())
        async with grpc.aio.secure_channel(f"localhost:{_port(proxy)}", creds) as ch:
            reply = await stubs.generate(ch)(gen.GenerateRequest(prompt="a b", max_tokens=2), timeout=10)
        assert reply is not None and echo.calls == 1
    finally:
        await echo.stop()


async def test_mtls_required_refuses_a_client_without_a_certificate(pki: Pki, backend: FakeBackend,
                                                                    make_proxy: ProxyFactory) -> None:
    extra = f"client_ca_file: '{pki.ca_file}'\nclient_auth: required\n"
    proxy = await make_proxy(tls_listen(pki, extra) + backend_line(backend.url))
    async with httpx.AsyncClient(verify=pki.client_context()) as anonymous:
        with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
            await anonymous.get(proxy.http_url + "/v1/models")
    cert, key = pki.issue("client", "client.example")
    ctx = pki.client_context()
    ctx.load_cert_chain(str(cert), str(key))
    async with httpx.AsyncClient(verify=ctx) as known:
        r = await known.get(proxy.http_url + "/v1/models")
        assert r.status_code == 200


async def test_admin_listener_over_tls(pki: Pki, backend: FakeBackend, make_proxy: ProxyFactory) -> None:
    tls = f"{{cert_file: '{pki.cert_file}', key_file: '{pki.key_file}'}}"
    # Not make_proxy: its `admin: {port: 0}` would make this `admin` a duplicate key.
    proxy = AffinityProxy(parse_config(
        "telemetry: {enabled: false}\nhealth_checks: {enabled: false}\nlisten: {port: 0}\n"
        f"admin: {{port: 0, tls: {tls}}}\n" + backend_line(backend.url)))
    await proxy.start()
    try:
        assert proxy.admin_url.startswith("https://")
        # The admin listener offers http/1.1 alone: an h2-capable client (curl, httpx http2) stays on 1.1.
        async with httpx.AsyncClient(verify=pki.client_context(), http2=True) as http:
            r = await http.get(proxy.admin_url + "/healthz")
            assert r.status_code == 200 and r.http_version == "HTTP/1.1"
    finally:
        await proxy.stop()


def _served_der(port: int, ctx: ssl.SSLContext) -> bytes:
    import socket
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with ctx.wrap_socket(raw, server_hostname="localhost") as s:
            der = s.getpeercert(binary_form=True)
            assert der is not None
            return der


def _file_der(path: Path) -> bytes:
    pem = path.read_text()
    first = pem[pem.index("-----BEGIN CERTIFICATE-----"):]
    return ssl.PEM_cert_to_DER_cert(first[: first.index("-----END CERTIFICATE-----") + 25])


async def test_replaced_certificate_is_served_to_new_connections_while_an_open_stream_completes(
        pki: Pki, backend: FakeBackend, make_proxy: ProxyFactory) -> None:
    backend.events = 6
    backend.event_delay = 0.15
    proxy = await make_proxy(tls_listen(pki, "watch_interval_s: 0.1\n") + backend_line(backend.url))
    port = _port(proxy)
    old = _file_der(pki.cert_file)
    assert await asyncio.to_thread(_served_der, port, pki.client_context()) == old
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with httpx.AsyncClient(verify=pki.client_context()) as http:
        async with http.stream("POST", proxy.http_url + "/v1/chat/completions", json=body) as r:
            raw = r.aiter_raw()
            chunks = [await raw.__anext__()]  # the stream is open on the old certificate
            # Replace the pair on disk (key first, then the chain: a reader may see the pair half-written).
            new_cert, new_key = pki.issue("next")
            os.replace(new_key, pki.key_file)
            os.replace(new_cert, pki.cert_file)
            new = _file_der(pki.cert_file)
            assert new != old
            await until(lambda: proxy.tls["listen"].generation == 2, timeout=3)
            assert await asyncio.to_thread(_served_der, port, pki.client_context()) == new
            async for chunk in raw:
                chunks.append(chunk)
    text = b"".join(chunks).decode()
    assert text.count("data: ") == backend.events + 1 and "[DONE]" in text


async def test_grpc_listen_with_its_own_tls(pki: Pki, make_proxy: ProxyFactory) -> None:
    echo = EchoBackend("echo-0")
    await echo.start()
    try:
        tls = f"{{cert_file: '{pki.cert_file}', key_file: '{pki.key_file}'}}"
        proxy = await make_proxy(f"listen: {{port: 0}}\ngrpc_listen: {{port: 0, tls: {tls}}}\n"
                                 + backend_line("http://127.0.0.1:9", "echo-0", echo.address))
        assert proxy.grpc is not None
        creds = grpc.ssl_channel_credentials(root_certificates=pki.ca_file.read_bytes())
        async with grpc.aio.secure_channel(f"localhost:{proxy.grpc.port}", creds) as ch:
            reply = await stubs.generate(ch)(gen.GenerateRequest(prompt="a b", max_tokens=2), timeout=10)
        assert reply is not None and echo.calls == 1
    finally:
        await echo.stop()


async def test_min_version_and_optional_client_auth(pki: Pki, backend: FakeBackend, make_proxy: ProxyFactory) -> None:
    extra = f"min_version: '1.3'\nclient_ca_file: '{pki.ca_file}'\nclient_auth: optional\n"
    proxy = await make_proxy(tls_listen(pki, extra) + backend_line(backend.url))
    old = pki.client_context()
    old.maximum_version = ssl.TLSVersion.TLSv1_2
    async with httpx.AsyncClient(verify=old) as tls12:
        with pytest.raises(httpx.ConnectError):
            await tls12.get(proxy.http_url + "/v1/models")
    async with httpx.AsyncClient(verify=pki.client_context()) as anonymous:  # optional: no certificate is fine
        assert (await anonymous.get(proxy.http_url + "/v1/models")).status_code == 200
