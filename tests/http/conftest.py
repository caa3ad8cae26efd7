from __future__ import annotations

from typing import AsyncIterator, Awaitable, Callable

import pytest

from proxy.app import AffinityProxy
from proxy.config import parse_config
from tests.support import FakeBackend

ProxyFactory = Callable[..., Awaitable[AffinityProxy]]

# Free ports, and no background traffic: the fakes record every request they get, and these tests assert
# exactly what the data plane sent (telemetry scrapes and health checks have their own tests).
QUIET = "listen: {port: 0}\nadmin: {port: 0}\ntelemetry: {enabled: false}\nhealth_checks: {enabled: false}\n"


@pytest.fixture
async def backends() -> AsyncIterator[list[FakeBackend]]:
    fakes = [FakeBackend("b0"), FakeBackend("b1")]
    for f in fakes:
        await f.start()
    yield fakes
    for f in fakes:
        await f.stop()


@pytest.fixture
async def make_proxy() -> AsyncIterator[ProxyFactory]:
    """Start a proxy on free ports in front of the given fakes; `extra` is appended to the YAML."""
    started: list[AffinityProxy] = []

    async def make(fakes: list[FakeBackend], extra: str = "", policy: str = "round_robin",
                   backend_extra: str = "") -> AffinityProxy:
        lines = "\n".join(f"  - {{name: {f.name}, url: '{f.url}'{backend_extra}}}" for f in fakes)
        text = f"{QUIET}routing: {{policy: {policy}}}\nbackends:\n{lines}\n{extra}"
        proxy = AffinityProxy(parse_config(text))
        await proxy.start()
        started.append(proxy)
        return proxy

    yield make
    for p in started:
        await p.stop()
