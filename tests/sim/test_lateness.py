"""The simulator says when it falls behind its own engine model (sim_step_late_* on /metrics): a live load
test on a busy machine reads its latencies against that (loadtest/live_replicas.py)."""

from __future__ import annotations

import asyncio
import time

import httpx

from loadtest.fleet_sampler import parse_exposition, pick
from sim.fleet import start_fleet
from tests.support import until


async def test_a_blocked_event_loop_shows_as_late_steps_on_metrics() -> None:
    fleet = await start_fleet(1, speed=1.0)  # real time: one simulated second per second
    try:
        server = fleet.servers[0]
        async with httpx.AsyncClient(base_url=server.url, timeout=30.0) as h:
            before, _ = parse_exposition((await h.get("/metrics")).text)
            assert pick(before, "steps") == 0.0 and pick(before, "late_s") == 0.0
            answer = asyncio.create_task(
                h.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 200, "ignore_eos": True}))
            await until(lambda: server.backend.steps > 3)
            time.sleep(0.3)  # the process's CPU is elsewhere: the driver cannot deliver steps on time
            assert (await answer).status_code == 200
            after, _ = parse_exposition((await h.get("/metrics")).text)
    finally:
        await fleet.stop()
    steps, late, most = pick(after, "steps"), pick(after, "late_s"), pick(after, "late_max_s")
    assert steps is not None and late is not None and most is not None
    assert steps >= 200  # a decode step per token at least
    assert most >= 0.25  # the step due during the block went out that late
    assert late >= most  # and every step after it, until the engine went idle, was late too
    # The engine's own TTFT histogram, which a live report reads against the client's (report.summarize).
    assert pick(before, "ttft_count") == 0.0 and pick(after, "ttft_count") == 1.0
    assert 0.0 < (pick(after, "ttft_sum") or 0.0) < 1.0
