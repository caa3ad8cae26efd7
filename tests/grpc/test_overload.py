"""Overload answers for gRPC calls: grpc-retry-pushback-ms (gRPC's Retry-After) on every shed call, honoured
by grpcio's own retry policy; overload.action=queue for gRPC is covered in test_balancing and
test_deadlines."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from proxy.core.snapshot import Health
from proxy.protos import generate_pb2 as gen
from tests.grpc import stubs
from tests.grpc.conftest import echo_entries, proxy_address
from tests.grpc.echo import EchoBackend
from tests.support import until


async def _shed(proxy, channel_to) -> grpc.aio.AioRpcError:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stubs.generate(channel_to(proxy_address(proxy)))(gen.GenerateRequest(prompt="b"))
    return info.value


@pytest.mark.parametrize("status, code", [(429, grpc.StatusCode.RESOURCE_EXHAUSTED),
                                          (503, grpc.StatusCode.UNAVAILABLE)])
async def test_overload_answer_carries_retry_pushback(status: int, code: grpc.StatusCode,
                                                      echoes: list[EchoBackend], make_proxy, channel_to) -> None:
    proxy = await make_proxy(echo_entries(echoes[:1]), extra="overload: {max_inflight_per_backend: 1, "
                             f"reject_status: {status}, retry_after_s: 3}}\n")
    busy = stubs.generate_stream(channel_to(proxy_address(proxy)))(
        gen.GenerateRequest(prompt="a", max_tokens=0, temperature=0.05))
    await busy.read()
    err = await _shed(proxy, channel_to)
    assert err.code() == code and "saturated" in (err.details() or "")
    assert dict(err.trailing_metadata())["grpc-retry-pushback-ms"] == "3000"  # overload.retry_after_s
    busy.cancel()


async def test_no_backend_answer_carries_one_second_pushback(make_proxy, channel_to) -> None:
    proxy = await make_proxy([("gone", "http://127.0.0.1:9", "127.0.0.1:9")])
    proxy.store.update(lambda s: s.replace_backend("gone", health=Health.DRAINING))
    err = await _shed(proxy, channel_to)
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert dict(err.trailing_metadata())["grpc-retry-pushback-ms"] == "1000"  # as HTTP's Retry-After: 1


async def test_grpcio_retry_policy_waits_out_the_pushback(echoes: list[EchoBackend], make_proxy,
                                                          channel_to) -> None:
    """A client retrying UNAVAILABLE a few milliseconds apart would use up its attempts while the backend
    is busy; told to push back 1 s, grpcio waits, and its retry finds the slot the busy call freed."""
    proxy = await make_proxy(echo_entries(echoes[:1]),
                             extra="overload: {max_inflight_per_backend: 1, retry_after_s: 1}\n")
    service_config = json.dumps({"methodConfig": [{
        "name": [{"service": "affinity.v1.Generation"}],
        "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.001s", "maxBackoff": "0.001s",
                        "backoffMultiplier": 1, "retryableStatusCodes": ["UNAVAILABLE"]},
    }]})
    ch = channel_to(proxy_address(proxy), options=[("grpc.service_config", service_config),
                                                   ("grpc.enable_retries", 1)])
    busy = stubs.generate_stream(ch)(gen.GenerateRequest(prompt="a", max_tokens=0, temperature=0.05))
    await busy.read()
    shed_before = proxy.metrics._errors.get("overloaded", 0)  # noqa: SLF001
    call = asyncio.ensure_future(stubs.generate(ch)(gen.GenerateRequest(prompt="b")))
    await until(lambda: proxy.metrics._errors.get("overloaded", 0) != shed_before, interval=0.005,  # noqa: SLF001
                message="the first attempt is shed")
    busy.cancel()  # capacity is back well within the pushback
    resp = await asyncio.wait_for(call, 30)  # bounded: a client that never gets its answer fails here
    assert resp.text == "b"
    assert proxy.metrics._errors.get("overloaded", 0) == shed_before + 1  # noqa: SLF001  # one shed, one retry
