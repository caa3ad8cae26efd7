"""Certificates made in the tests (trustme): a CA, the proxy's server pair, client pairs, all in tmp_path."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable

import pytest
import trustme

from proxy.app import AffinityProxy
from proxy.config import parse_config
from tests.support import FakeBackend

QUIET = "telemetry: {enabled: false}\nhealth_checks: {enabled: false}\nadmin: {port: 0}\n"


@dataclass
class Pki:
    ca: trustme.CA
    ca_file: Path
    cert_file: Path  # the server certificate chain (localhost, 127.0.0.1)
    key_file: Path
    dir: Path

    def issue(self, stem: str, *names: str, ca: trustme.CA | None = None) -> tuple[Path, Path]:
        """A fresh pair written to <stem>.pem / <stem>.key (signed by `ca`, this CA by default)."""
        cert = (ca or self.ca).issue_cert(*(names or ("localhost", "127.0.0.1")))
        chain, key = self.dir / f"{stem}.pem", self.dir / f"{stem}.key"
        cert.private_key_and_cert_chain_pem.write_to_path(str(chain))
        cert.private_key_pem.write_to_path(str(key))
        return chain, key

    def client_context(self, alpn: tuple[str, ...] = ("http/1.1",)) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        ctx.set_alpn_protocols(list(alpn))
        return ctx


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    ca = trustme.CA()
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    p = Pki(ca, ca_file, tmp_path / "server.pem", tmp_path / "server.key", tmp_path)
    p.issue("server")
    return p


@pytest.fixture
async def backend() -> AsyncIterator[FakeBackend]:
    b = FakeBackend("fake")
    await b.start()
    yield b
    await b.stop()


ProxyFactory = Callable[..., Awaitable[AffinityProxy]]


@pytest.fixture
async def make_proxy() -> AsyncIterator[ProxyFactory]:
    started: list[AffinityProxy] = []

    async def make(text: str) -> AffinityProxy:
        proxy = AffinityProxy(parse_config(QUIET + text))
        await proxy.start()
        started.append(proxy)
        return proxy

    yield make
    for p in started:
        await p.stop()


def tls_listen(pki: Pki, extra: str = "") -> str:
    return (f"listen:\n  port: 0\n  tls:\n    cert_file: '{pki.cert_file}'\n    key_file: '{pki.key_file}'\n"
            + "".join(f"    {line}\n" for line in extra.splitlines() if line))


def backend_line(url: str, name: str = "fake", grpc: str | None = None) -> str:
    extra = f", grpc: '{grpc}'" if grpc else ""
    return f"backends:\n  - {{name: {name}, url: '{url}'{extra}}}\n"
