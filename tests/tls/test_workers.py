"""--workers N with TLS: SSL contexts do not pickle, so every worker builds its own from the config."""

from __future__ import annotations

import httpx

from tests.deploy.procs import AFFINITY_PROXY, start_proxy
from tests.support import FakeBackend
from tests.tls.conftest import Pki


async def test_every_worker_serves_tls_and_h2_on_the_shared_port(pki: Pki, backend: FakeBackend) -> None:
    cfg = pki.dir / "config.yaml"
    cfg.write_text(
        "listen:\n  host: 127.0.0.1\n  port: 0\n"
        f"  tls: {{cert_file: '{pki.cert_file}', key_file: '{pki.key_file}'}}\n"
        "admin: {host: 127.0.0.1, port: 0}\ndebug_headers: true\n"
        "telemetry: {enabled: false}\nhealth_checks: {enabled: false}\n"
        f"backends:\n  - {{name: fake, url: '{backend.url}'}}\n")
    proxy = await start_proxy([AFFINITY_PROXY, "run", "--config", str(cfg), "--workers", "2"])
    try:
        assert len(proxy.workers()) == 2
        url = f"https://127.0.0.1:{proxy.port}/v1/completions"
        body = {"model": "fake-model", "prompt": "hi", "max_tokens": 2}
        for http2 in (False, True):
            for _ in range(8):  # a fresh connection (and handshake) each: the kernel spreads them over workers
                async with httpx.AsyncClient(verify=pki.client_context(), http2=http2) as client:
                    r = await client.post(url, json=body)
                    assert r.status_code == 200, r.text
                    assert r.http_version == ("HTTP/2" if http2 else "HTTP/1.1")
    finally:
        await proxy.terminate()
