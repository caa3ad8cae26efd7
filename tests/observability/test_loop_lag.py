"""The event-loop lag gauge: a callback that holds the loop shows up as lag, and every proxy process
exports it on /metrics."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from proxy.app import AffinityProxy
from proxy.config import parse_config
from proxy.observability.loop_lag import LAG_BUCKETS, LoopLag


def _exported(lag: LoopLag) -> dict[str, float]:
    hist, worst = lag.collect()
    out = {s.name + s.labels.get("le", ""): s.value for s in hist.samples}
    out["max"] = worst.samples[0].value
    return out


def test_observations_fall_in_their_buckets() -> None:
    lag = LoopLag()
    for v in (0.0004, 0.003, 0.003, 0.04, 5.0, -0.001):
        lag.observe(v)
    got = _exported(lag)
    assert got["affinity_proxy_event_loop_lag_seconds_count"] == 6
    assert got["affinity_proxy_event_loop_lag_seconds_bucket0.001"] == 2  # the negative one reads as 0
    assert got["affinity_proxy_event_loop_lag_seconds_bucket0.005"] == 4
    assert got["affinity_proxy_event_loop_lag_seconds_bucket0.05"] == 5
    assert got["affinity_proxy_event_loop_lag_seconds_bucket" + repr(LAG_BUCKETS[-1])] == 5
    assert got["affinity_proxy_event_loop_lag_seconds_bucket+Inf"] == 6
    assert got["affinity_proxy_event_loop_lag_seconds_sum"] == pytest.approx(5.0464)
    assert got["max"] == 5.0
    with pytest.raises(ValueError):
        LoopLag(0)


async def test_a_callback_holding_the_loop_is_seen_as_lag() -> None:
    lag = LoopLag(interval_s=0.01)
    task = asyncio.create_task(lag.run())
    try:
        await asyncio.sleep(0.05)
        asyncio.get_running_loop().call_soon(time.sleep, 0.06)  # holds the loop for 60 ms
        await asyncio.sleep(0.1)
    finally:
        task.cancel()
    assert lag.max_s >= 0.045, lag.max_s  # the timer due during the block ran when it ended
    assert sum(lag.hist.counts[bisect] for bisect in range(LAG_BUCKETS.index(0.025) + 1, len(LAG_BUCKETS) + 1)) >= 1


async def test_the_proxy_exports_its_loop_lag() -> None:
    proxy = AffinityProxy(parse_config(
        "listen: {host: 127.0.0.1, port: 0}\nadmin: {host: 127.0.0.1, port: 0}\n"
        "backends:\n  - {name: a, url: 'http://127.0.0.1:9'}\n", "<test>"))
    await proxy.start()
    try:
        await asyncio.sleep(0.35)
        async with httpx.AsyncClient() as c:
            text = (await c.get(proxy.admin_url + "/metrics")).text
    finally:
        await proxy.stop()
    (count,) = [line for line in text.splitlines() if line.startswith("affinity_proxy_event_loop_lag_seconds_count")]
    assert float(count.split()[-1]) >= 2
    assert "affinity_proxy_event_loop_lag_max_seconds" in text
