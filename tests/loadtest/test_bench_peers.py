"""The side-by-side benchmark's own pieces that need no peers installed: the 1-connection client, the
h2load summary parser and the extra table."""

from __future__ import annotations

import asyncio

from loadtest.bench_peers import c1_latencies, extra_table, parse_h2load
from tests.support.backend import FakeBackend


async def test_the_one_connection_client_times_every_request_of_a_kept_alive_connection() -> None:
    backend = FakeBackend()
    await backend.start()
    try:
        r = await asyncio.to_thread(c1_latencies, backend.port, 0.3)
    finally:
        await backend.stop()
    assert r["requests"] >= 2
    assert len(backend.seen) == r["requests"]  # one answer read per request, none left behind
    assert 0 < r["p50_us"] <= r["p99_us"] <= r["p999_us"]
    bodies = {s.body for s in backend.seen}
    assert len(bodies) == len(backend.seen)  # a unique suffix per request, as post_completions.lua sends


def test_h2load_summary_gives_succeeded_requests_per_second() -> None:
    out = ("finished in 4.00s, 5000.00 req/s, 1.2MB/s\n"
           "requests: 20000 total, 20064 started, 20000 done, 19990 succeeded, 10 failed, 0 errored, 0 timeout\n")
    assert parse_h2load(out) == {"requests": 19990.0, "rps": 19990.0 / 4.0}
    assert parse_h2load(out.replace("4.00s", "500.00ms"))["rps"] == 19990.0 / 0.5


def test_extra_table_pairs_added_latency_with_direct_of_the_same_repetition() -> None:
    raw = {"targets": ["direct", "ap-rr"], "results": {
        "direct": {"h1_c1": [{"rep": 0, "p50_us": 20.0, "p99_us": 40.0, "p999_us": 90.0, "requests": 100.0},
                             {"rep": 1, "p50_us": 30.0, "p99_us": 60.0, "p999_us": 90.0, "requests": 100.0}]},
        "ap-rr": {"h1_c1": [{"rep": 0, "p50_us": 120.0, "p99_us": 340.0, "p999_us": 900.0, "requests": 50.0},
                            {"rep": 1, "p50_us": 130.0, "p99_us": 360.0, "p999_us": 900.0, "requests": 50.0}],
                  "h1_cpu": [{"rep": 0, "cpu_us": 60.0}, {"rep": 1, "cpu_us": 70.0}]}}}
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:] for line in extra_table(raw).splitlines()[2:]}
    assert rows["added p50 at 1 connection (µs, minus direct's)"][-1].strip(" |") == "100"
    assert rows["added p99 at 1 connection (µs, minus direct's)"][-1].strip(" |") == "300"
    assert rows["p99 at 1 connection, HTTP/1.1 (µs)"][0] == "50"  # direct's own, beside
    assert rows["CPU µs per small POST, HTTP/1.1, 64 connections"][-1].strip(" |") == "65.0"
    assert rows["CPU µs per small POST, h2c, 16 conns x 4 streams"][-1].strip(" |") == "-"
