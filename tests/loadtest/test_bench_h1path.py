"""loadtest/bench_h1path.py: the in-process request path runs, with and without its optional pieces."""

from __future__ import annotations

import asyncio

from loadtest import bench_h1path


async def test_the_bench_serves_with_every_piece_and_without_each() -> None:
    # (a request left unanswered would leave the fake client waiting: bounded here)
    full = await asyncio.wait_for(bench_h1path._run("round_robin", 200, 2, None, False), 60)
    assert full["us_per_request"] > 0
    rest = tuple(p for p in bench_h1path.WITHOUT if p != "observability")
    for without in (("observability",), rest):
        out = await asyncio.wait_for(bench_h1path._run("affinity", 200, 2, None, False, without=without), 60)
        assert out["us_per_request"] > 0  # every answer was a 200 (the fake client raises on anything else)
