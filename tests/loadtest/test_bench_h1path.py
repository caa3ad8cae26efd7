"""loadtest/bench_h1path.py: the in-process request path runs, with and without its optional pieces."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

from loadtest import bench_h1path
from proxy.native.loader import status

REPO = Path(__file__).resolve().parents[2]


async def test_the_bench_serves_with_every_piece_and_without_each() -> None:
    # (a request left unanswered would leave the fake client waiting: bounded here)
    full = await asyncio.wait_for(bench_h1path._run("round_robin", 200, 2, None, False), 60)
    assert full["us_per_request"] > 0
    rest = tuple(p for p in bench_h1path.WITHOUT if p != "observability"
                 and not (status().active and p in bench_h1path.PATCHED))
    for without in (("observability",), rest):
        out = await asyncio.wait_for(bench_h1path._run("affinity", 200, 2, None, False, without=without), 60)
        assert out["us_per_request"] > 0  # every answer was a 200 (the fake client raises on anything else)


def test_the_pieces_taken_off_by_a_method_run_on_the_python_source() -> None:
    args = [a for p in bench_h1path.PATCHED for a in ("--without", p)]
    r = subprocess.run([sys.executable, "loadtest/bench_h1path.py", "--policy", "affinity", "--requests", "200",
                        "--conns", "2", *args], cwd=REPO, env=dict(os.environ, AFFINITY_PROXY_NATIVE="0"),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "us_per_request" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
