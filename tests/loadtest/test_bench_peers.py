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


def test_an_arm_names_a_tree_and_its_environment() -> None:
    import os

    import pytest

    from loadtest.bench_peers import parse_arm

    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert parse_arm("this=.") == ("this", here, {})
    assert parse_arm("gc=/x/y,AFFINITY_PROXY_GC=default,A=b=c") == ("gc", "/x/y", {"AFFINITY_PROXY_GC": "default", "A": "b=c"})
    for bad in ("this", "=.", "x=.,NOVALUE"):
        with pytest.raises(SystemExit):
            parse_arm(bad)


def test_ab_c1_table_gives_medians_of_per_round_ratios_against_the_first_arm() -> None:
    from loadtest.bench_peers import ab_c1_table

    def r(rnd: int, p50: float, p99: float) -> dict[str, float]:
        return {"round": rnd, "p50_us": p50, "p99_us": p99, "p999_us": 2 * p99, "cpu_us": p50 / 2, "requests": 10.0}

    raw = {"policy": "round_robin", "rounds": 3, "secs": 4.0, "arms": [["base", "/b", {}], ["this", "/t", {}]],
           "results": {"direct": [r(0, 10, 20), r(1, 10, 20), r(2, 10, 20)],
                       "base": [r(0, 100, 420), r(1, 100, 220), r(2, 100, 320)],
                       "this": [r(0, 90, 220), r(1, 110, 420), r(2, 80, 160)]}}
    lines = ab_c1_table(raw).splitlines()
    this = next(line for line in lines if line.startswith("| this | 0"))
    cells = this.split(" | ")[1:]
    # per round p50 ratios 0.9, 1.1, 0.8 -> median 0.9, lower in 2 of 3; p99 ratios 0.52, 1.91, 0.5 -> 0.524
    assert cells[0] == "0.900× (2/3)"
    assert cells[1] == "0.524× (2/3)"
    # added p99: (220-20)/(420-20), (420-20)/(220-20), (160-20)/(320-20) -> median 0.5
    assert cells[4].rstrip(" |") == "0.500× (2/3)"
    medians = next(line for line in lines if line.startswith("| this | 90"))
    assert [c.rstrip(" |") for c in medians.split(" | ")[5:7]] == ["80", "200"]  # minus direct, same round


def test_an_affinity_proxy_target_name_says_policy_log_and_which_tree_or_interpreter() -> None:
    from loadtest.bench_peers import ap_target

    assert ap_target("ap-rr") == ("round_robin", False, "")
    assert ap_target("ap-aff-nolog") == ("affinity", True, "")
    assert ap_target("ap-rr-base") == ("round_robin", False, "base")
    assert ap_target("ap-aff-nolog-alt") == ("affinity", True, "alt")
    assert ap_target("ap-rr-src") == ("round_robin", False, "src")  # the Python source, not the compiled path
    for other in ("vllm-rr", "nginx", "ap-x", "ap-rr-alt-base", "ap-rr-src-alt", "ap-rr-gc", "ap"):
        assert ap_target(other) is None


def test_every_raw_result_says_which_build_of_this_tree_ran() -> None:
    from loadtest.bench_peers import native_state
    from proxy.native.loader import status

    state = native_state()  # read by the loader's file, as the peers' interpreter (no installed proxy) does
    assert state["native"] in ("on", "off", "stale", "none")
    assert (state["native"] == "on") == status().active  # this process and a fresh check agree
