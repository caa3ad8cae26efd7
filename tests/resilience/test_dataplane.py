"""Retries, passive ejection, overload shedding/queueing and panic through a real proxy and fake backends."""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator

import aiohttp
import pytest

from proxy.app import AffinityProxy
from proxy.config import parse_config
from proxy.core.decision import NoBackendAvailable, Outcome
from proxy.core.retry_policy import RetryConfig
from proxy.core.request import RequestSummary
from proxy.core.snapshot import Health
from proxy.dataplane.retry import Attempts, RetryController, RetryableFailure

from tests.support import free_port, until

BASE = "listen: {port: 0}\nadmin: {port: 0}\ntelemetry: {enabled: false}\nhealth_checks: {enabled: false}\n"
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
async def proxies() -> AsyncIterator[list[AffinityProxy]]:
    started: list[AffinityProxy] = []
    yield started
    for p in started:
        await p.stop()


async def start_proxy(started: list[AffinityProxy], backends: list[tuple[str, str]], extra: str = "") -> AffinityProxy:
    lines = "\n".join(f"  - {{name: {n}, url: '{u}'}}" for n, u in backends)
    proxy = AffinityProxy(parse_config(f"{BASE}debug_headers: true\nrouting: {{policy: round_robin}}\n"
                                       f"backends:\n{lines}\n{extra}"))
    await proxy.start()
    started.append(proxy)
    return proxy


async def post(session: aiohttp.ClientSession, proxy: AffinityProxy, body: dict) -> tuple[int, dict, bytes]:
    async with session.post(proxy.http_url + "/v1/chat/completions", json=body) as r:
        return r.status, dict(r.headers), await r.read()


async def test_connect_failure_is_retried_on_another_backend(fakes, proxies) -> None:
    dead = ("dead", f"http://127.0.0.1:{free_port()}")
    proxy = await start_proxy(proxies, [dead, (fakes[0].name, fakes[0].url)],
                              "outlier_detection: {consecutive_connect_failures: 100}\n")
    async with aiohttp.ClientSession() as s:
        results = [await post(s, proxy, CHAT) for _ in range(6)]
    assert [r[0] for r in results] == [200] * 6
    assert {r[1]["x-affinity-backend"] for r in results} == {"b0"}
    retried = proxy.resilience.retries.retried
    assert retried >= 3  # round robin keeps offering the dead one (no ejection here): each is retried
    assert proxy.resilience.metrics.retries.labels("connect_failure")._value.get() == retried


async def test_503_and_429_are_retried_elsewhere_and_held_back(fakes, proxies) -> None:
    fakes[0].status = 503
    fakes[1].status = 429
    proxy = await start_proxy(proxies, [(f.name, f.url) for f in fakes],
                              "retries: {budget_percent: 100}\noutlier_detection: {consecutive_5xx: 100}\n")
    async with aiohttp.ClientSession() as s:
        results = [await post(s, proxy, CHAT) for _ in range(6)]
    assert [r[0] for r in results] == [200] * 6 and {r[1]["x-affinity-backend"] for r in results} == {"b2"}
    assert len(fakes[2].seen) == 6


async def test_retry_gives_up_with_the_last_answer_when_no_backend_is_left(fakes, proxies) -> None:
    fakes[0].status = 503
    proxy = await start_proxy(proxies, [(fakes[0].name, fakes[0].url)])
    async with aiohttp.ClientSession() as s:
        status, _, body = await post(s, proxy, CHAT)
    assert status == 503 and json.loads(body)["error"]["message"] == "backend says no"  # the backend's own answer


async def test_never_retried_after_the_first_streamed_byte(fakes, proxies) -> None:
    fakes[0].die_after_events = 1
    fakes[0].events = 3
    proxy = await start_proxy(proxies, [(f.name, f.url) for f in fakes[:2]], "retries: {budget_percent: 100}\n")
    async with aiohttp.ClientSession() as s:
        status, headers, body = await post(s, proxy, {**CHAT, "stream": True})
    assert status == 200 and headers["x-affinity-backend"] == "b0"
    text = body.decode()
    assert text.count('"t0 "') == 1 and "upstream_stream_error" in text  # one partial answer, then a clean error
    assert len(fakes[1].seen) == 0 and proxy.resilience.retries.retried == 0


def test_retry_budget_bounds_retries() -> None:
    """The shared budget, through `Attempts` (what every data plane's retry loop keeps per request)."""
    ctl = RetryController(RetryConfig(budget_percent=0, min_retries_per_s=0.1, budget_window_ms=10_000,
                                      backoff_base_ms=0, backoff_max_ms=0))
    failure = RetryableFailure(Outcome.CONNECT_FAILURE, "502")
    first = Attempts(ctl)
    assert first.retry(failure, frozenset({"a"})) == 0.0  # the budget (1 retry per 10 s) allows exactly one
    assert first.count == 2 and first.exclude == {"a"}
    assert first.retry(failure, frozenset({"a", "b"})) is None  # then no more
    second = Attempts(ctl)
    assert second.retry(failure, frozenset({"a"})) is None
    assert second.count == 1 and second.exclude == frozenset()
    assert ctl.retried == 1
    assert ctl.metrics.retries_denied.labels("budget")._value.get() == 2  # after b, then after a


async def test_consecutive_5xx_eject_the_backend(fakes, proxies) -> None:
    fakes[0].status = 500
    proxy = await start_proxy(proxies, [(f.name, f.url) for f in fakes],
                              "outlier_detection: {consecutive_5xx: 2, base_ejection_ms: 60000}\n")
    async with aiohttp.ClientSession() as s:
        statuses = [(await post(s, proxy, CHAT))[0] for _ in range(12)]
    assert statuses.count(500) == 2  # two answers from b0, then it is out of rotation
    assert proxy.store.current.get("b0").health is Health.UNHEALTHY


async def test_saturated_fleet_answers_429_with_retry_after(fakes, proxies) -> None:
    fakes[0].hang_stream = True
    proxy = await start_proxy(proxies, [(fakes[0].name, fakes[0].url)],
                              "overload: {max_inflight_per_backend: 1, reject_status: 429, retry_after_s: 3}\n")
    async with aiohttp.ClientSession() as s:
        held = await s.post(proxy.http_url + "/v1/chat/completions", json={**CHAT, "stream": True})
        await held.content.readline()
        status, headers, body = await post(s, proxy, CHAT)
        held.close()
    assert status == 429 and headers["Retry-After"] == "3"
    assert json.loads(body)["error"]["code"] == "overloaded"


async def test_queue_mode_holds_requests_until_capacity_frees_then_times_out(fakes, proxies) -> None:
    fakes[0].hang_stream = True
    proxy = await start_proxy(proxies, [(fakes[0].name, fakes[0].url)],
                              "overload: {max_inflight_per_backend: 1, action: queue, queue_timeout_ms: 5000,"
                              " queue_size: 1}\n")
    async with aiohttp.ClientSession() as s:
        held = await s.post(proxy.http_url + "/v1/chat/completions", json={**CHAT, "stream": True})
        await held.content.readline()
        waiting = asyncio.create_task(post(s, proxy, CHAT))
        await until(lambda: len(proxy.resilience.queue) == 1)
        status, _, _ = await post(s, proxy, CHAT)  # the queue (size 1) is full: answered at once
        assert status == 503
        fakes[0].hang_stream = False
        held.close()  # the held stream ends: its slot goes to the waiting request
        status, headers, _ = await waiting
    assert status == 200 and proxy.resilience.queue.admitted_after_wait == 1


async def test_queue_wait_is_bounded(fakes, proxies) -> None:
    fakes[0].hang_stream = True
    proxy = await start_proxy(proxies, [(fakes[0].name, fakes[0].url)],
                              "overload: {max_inflight_per_backend: 1, action: queue, queue_timeout_ms: 100}\n")
    async with aiohttp.ClientSession() as s:
        held = await s.post(proxy.http_url + "/v1/chat/completions", json={**CHAT, "stream": True})
        await held.content.readline()
        status, headers, _ = await post(s, proxy, CHAT)
        held.close()
    assert status == 503 and headers["Retry-After"] == "1" and proxy.resilience.queue.timed_out == 1


async def test_panic_routes_to_unhealthy_backends_when_too_few_are_healthy(fakes, proxies) -> None:
    proxy = await start_proxy(proxies, [(f.name, f.url) for f in fakes], "overload: {panic_threshold_percent: 50}\n")
    for name in ("b0", "b1"):
        proxy.store.update(lambda snap, n=name: snap.replace_backend(n, health=Health.UNHEALTHY))
    async with aiohttp.ClientSession() as s:
        served = {(await post(s, proxy, CHAT))[1]["x-affinity-backend"] for _ in range(6)}
    assert served == {"b0", "b1", "b2"}  # 1 of 3 healthy < 50 %: everyone serves
    proxy.store.update(lambda snap: snap.replace_backend("b1", health=Health.HEALTHY))
    async with aiohttp.ClientSession() as s:
        served = {(await post(s, proxy, CHAT))[1]["x-affinity-backend"] for _ in range(6)}
    assert served == {"b1", "b2"}


async def test_engine_signals_saturate_backends(fakes, proxies) -> None:
    from proxy.core.snapshot import Signals

    proxy = await start_proxy(proxies, [(f.name, f.url) for f in fakes[:2]],
                              "overload: {max_kv_usage: 0.95, max_waiting: 10}\n")
    full = Signals(scraped_at=0.0, kv_usage=0.99, waiting=0)
    queued = Signals(scraped_at=0.0, kv_usage=0.10, waiting=50)
    proxy.store.update(lambda s: s.replace_backend("b0", signals=full, stale=False))
    async with aiohttp.ClientSession() as s:
        served = {(await post(s, proxy, CHAT))[1]["x-affinity-backend"] for _ in range(4)}
        assert served == {"b1"}  # b0's KV cache is full: it gets nothing new
        proxy.store.update(lambda snap: snap.replace_backend("b1", signals=queued, stale=False))
        status, headers, body = await post(s, proxy, CHAT)
        assert status == 503 and headers["Retry-After"] == "1"
        assert json.loads(body)["error"]["code"] == "overloaded"
        proxy.store.update(lambda snap: snap.replace_backend("b1", stale=True))  # stale signals are not trusted
        assert (await post(s, proxy, CHAT))[0] == 200
