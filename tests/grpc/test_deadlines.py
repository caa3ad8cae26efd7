"""The proxy enforces grpc-timeout itself: whatever phase the call is in, it ends with DEADLINE_EXCEEDED
and the backend stream (if any) is reset, even against a client and a backend that never give up."""

from __future__ import annotations

from typing import AsyncIterator

import h2.errors
import pytest

from proxy.protos import generate_pb2 as gen
from tests.grpc.conftest import proxy_address
from tests.grpc.rawh2 import RawClient, SilentBackend

GENERATE = "/affinity.v1.Generation/Generate"
BIDI = "/affinity.v1.Generation/GenerateBidi"
MESSAGE = gen.GenerateRequest(prompt="a b c", max_tokens=4).SerializeToString()


@pytest.fixture
async def silent() -> AsyncIterator[SilentBackend]:
    b = SilentBackend()
    await b.start()
    yield b
    await b.stop()


@pytest.fixture
async def client_for():  # type: ignore[no-untyped-def]
    clients: list[RawClient] = []

    async def make(proxy) -> RawClient:  # type: ignore[no-untyped-def]
        c = await RawClient.connect(proxy_address(proxy))
        clients.append(c)
        return c

    yield make
    for c in clients:
        c.close()


async def test_deadline_enforced_on_a_backend_that_ignores_it(silent: SilentBackend, make_proxy, client_for) -> None:
    proxy = await make_proxy([("silent", "http://127.0.0.1:9", silent.address)])
    client = await client_for(proxy)
    sid = client.call(GENERATE, MESSAGE, timeout="200m")
    code, message = await client.status(sid)
    assert code == 4, message  # DEADLINE_EXCEEDED
    assert "deadline exceeded" in message and "silent" in message
    # The backend got the call with the remaining deadline, then a RST_STREAM(CANCEL) from the proxy.
    await silent.wait(lambda: silent.resets)
    assert silent.streams == 1 and silent.resets[0][1] == h2.errors.ErrorCodes.CANCEL
    assert proxy.inflight.total_requests == 0


async def test_deadline_counts_the_time_holding_the_first_message(silent: SilentBackend, make_proxy,
                                                                   client_for) -> None:
    # The hold would last a minute; the client's deadline is 200 ms.
    proxy = await make_proxy([("silent", "http://127.0.0.1:9", silent.address)],
                             extra="grpc: {first_message_timeout_s: 60}\n")
    client = await client_for(proxy)
    sid = client.call(BIDI, None, timeout="200m", end=False)
    code, message = await client.status(sid)
    assert code == 4 and "first message" in message, message
    assert silent.streams == 0  # never routed


async def test_deadline_counts_the_time_queued_for_capacity(silent: SilentBackend, make_proxy, client_for) -> None:
    proxy = await make_proxy([("silent", "http://127.0.0.1:9", silent.address)],
                             extra="overload: {max_inflight_per_backend: 1, action: queue, queue_timeout_ms: 60000}\n")
    client = await client_for(proxy)
    busy = client.call(GENERATE, MESSAGE)  # no deadline: occupies the only slot for good
    await silent.wait(lambda: silent.streams == 1)
    sid = client.call(GENERATE, MESSAGE, timeout="200m")
    code, message = await client.status(sid)
    assert code == 4 and "before the call reached a backend" in message, message
    assert proxy.router.queue is not None and len(proxy.router.queue) == 0  # left the overload queue
    assert silent.streams == 1
    client.conn.reset_stream(busy)
    client.flush()
    await silent.wait(lambda: silent.resets)


async def test_client_deadlines_never_eject_the_backend(silent: SilentBackend, make_proxy, client_for) -> None:
    # Outlier detection ejects after 2 consecutive 5xx here; five calls in a row end on the client's own
    # deadline. The deadline is the client's choice, not the backend failing: it must stay routable.
    proxy = await make_proxy([("silent", "http://127.0.0.1:9", silent.address)],
                             extra="outlier_detection: {consecutive_5xx: 2}\n")
    client = await client_for(proxy)
    for _ in range(5):
        code, message = await client.status(client.call(GENERATE, MESSAGE, timeout="50m"))
        assert code == 4, message
    state = proxy.store.current.get("silent")
    assert state is not None and state.health.routable, state.health
