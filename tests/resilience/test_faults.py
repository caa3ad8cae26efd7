"""Fault injection through the simulator under steady load (loadtest/resilience_report.py), counted.

Each test runs one scenario with short durations and asserts its invariants; the detection and restore
times are printed (run with -s) and reported by `python -m loadtest.resilience_report`, never asserted.
"""

from __future__ import annotations

from loadtest.resilience_report import (
    scenario_5xx,
    scenario_kill,
    scenario_no_duplicate,
    scenario_reload,
    scenario_stall,
    table,
)


async def test_killed_backend_fails_only_its_streams_cleanly_and_is_avoided() -> None:
    r = await scenario_kill(duration_s=1.6, kill_at=0.5)
    print("\n" + table([r]))
    assert r.sent > 20 and r.spliced == 0
    assert r.numbers["failed_elsewhere"] == 0  # only streams that were on the killed backend fail ...
    assert r.failed == r.failed_clean  # ... each with an error the client can parse, never a hang
    assert r.numbers["detected_after_s"] is not None
    # after the kill, requests are retried or routed elsewhere: the last attempt to it is bounded (reported)
    assert r.numbers["last_attempt_to_killed_after_s"] is not None


async def test_backend_stalled_3s_is_not_ejected() -> None:
    r = await scenario_stall(duration_s=3.8, stall_at=0.3, stall_ms=3000)
    print("\n" + table([r]))
    assert r.numbers["ejected"] is False
    assert r.numbers["check_timeouts"] >= 1  # the stall was seen by the checks ...
    assert r.failed == 0  # ... and nobody lost a request


async def test_5xx_backend_is_ejected_then_restored() -> None:
    r = await scenario_5xx(duration_s=2.4, fail_at=0.3, recover_at=1.0)
    print("\n" + table([r]))
    assert r.numbers["ejections"] >= 1 and r.numbers["ejected_after_s"] is not None
    assert r.failed == r.failed_clean == r.numbers["client_5xx"]
    # consecutive_5xx (3) per ejection, plus what the 6 clients already had in flight on it at that moment
    assert r.numbers["client_5xx"] <= (3 + 6) * r.numbers["ejections"]
    assert r.numbers["healthy_at_end"] and r.numbers["served_by_it_after_recovery"] > 0


async def test_reload_under_load_loses_nothing_and_invalid_keeps_serving() -> None:
    r = await scenario_reload(duration_s=2.4)
    print("\n" + table([r]))
    assert r.failed == 0 and r.sent > 20
    assert r.numbers["reloads_ok_invalid_ok"] == "ok/invalid/ok"
    assert r.numbers["invalid_kept_old_config"] and r.numbers["invalid_reported"] == 1
    assert r.numbers["drained_backends"] == ["sim-1 (idle)"] and r.numbers["served_by_sim-3"] > 0


async def test_retry_never_duplicates_a_streamed_answer() -> None:
    r = await scenario_no_duplicate(duration_s=1.0)
    print("\n" + table([r]))
    assert r.spliced == 0  # no stream carries two answers
    assert r.numbers["answers_from_503_backend"] == 0 and r.numbers["retries_on_503"] > 0
    assert r.numbers["cut_streams_clean"] > 0 and r.failed == r.failed_clean  # cut streams end with an error
