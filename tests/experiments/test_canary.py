"""A canary backend group with a slow build at 10%: weighted down on its TTFT rule, and no conversation that
started on the stable group ever moves to the canary (a cut only moves conversations out of a candidate)."""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

import pytest

from proxy.app import AffinityProxy
from proxy.config import parse_config
from sim.fleet import Fleet, start_fleet
from tests.experiments.helpers import Reply, load_until, proxy_yaml

CANARY = """  evaluate_every_s: 1
  window_s: 3
  definitions:
    - name: build
      control: stable
      cooldown_s: 2
      restore_after_s: 60
      arms:
        - {{name: stable}}
        - {{name: canary, share: 0.1, backends: [{canary}]}}
      guardrails:
        - {{when: "ttft_p99 > 1.2 x control", factor: 0.5, min_requests: 10}}
"""


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    f = await start_fleet(4, host="127.0.0.1", port=0, speed=50.0)
    yield f
    await f.stop()


async def test_slow_canary_is_weighted_down_and_stable_conversations_never_move_in(fleet: Fleet) -> None:
    canary = fleet.servers[3]
    proxy = AffinityProxy(parse_config(proxy_yaml(fleet, CANARY.format(canary=canary.name))))
    await proxy.start()
    model = fleet.servers[0].backend.engine.model_name
    slow = [True]

    async def slow_build() -> None:  # the new build stalls 80 ms out of every 160 ms
        while slow[0]:
            await canary.set_faults({"stall_ms": 80})
            await asyncio.sleep(0.16)

    stalls = asyncio.create_task(slow_build())
    runtime = proxy.experiments
    done_at: list[float] = []

    def stop() -> bool:
        if not done_at and runtime.weights("build")["canary"] <= 0.025 + 1e-9:
            done_at.append(time.monotonic())
        return bool(done_at) and time.monotonic() - done_at[0] > 3 or time.monotonic() - started > 40

    started = time.monotonic()
    try:
        convs = await load_until(proxy.http_url, model, stop, concurrency=12, turns=4, stream=True)
    finally:
        slow[0] = False
        await stalls
        history = runtime.as_json()["experiments"][0]["history"]
        await proxy.stop()
    assert done_at, f"the canary was not weighted down to 0.025: {history}"
    cuts = [h for h in history if h["action"] == "cut"]
    assert [round(h["new_weight"], 4) for h in cuts[:2]] == [0.05, 0.025]
    assert all("ttft_p99 > 1.2 x control" in h["reasons"][0] for h in cuts)
    replies: list[list[Reply]] = [c.replies for c in convs if c.replies]
    assert all(r.status == 200 for rs in replies for r in rs)
    started_on_canary = [rs for rs in replies if rs[0].backend == canary.name]
    started_on_stable = [rs for rs in replies if rs[0].backend != canary.name]
    assert started_on_canary and len(started_on_stable) > 10 * len(started_on_canary) // 2
    moved_in = [[r.backend for r in rs] for rs in started_on_stable if any(r.backend == canary.name for r in rs)]
    assert moved_in == []
