"""The Observer end to end without a proxy: records in, windows, rules, log lines, gauges and page data out."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, generate_latest

from proxy.core.hotspots import LATENCY_HOT_SPOT, SPREADING_ANOMALY, HotspotConfig
from proxy.observability.config import AccessLogConfig

from tests.observability.helpers import Clock, feed_fleet, make_observer, record

FLEET = ("gpu-0", "gpu-1", "gpu-2", "gpu-3")


def test_stalled_backend_becomes_a_hot_spot_with_a_log_line_a_gauge_and_marks(caplog):
    clock = Clock(1_800_000_000.0)
    registry = CollectorRegistry()
    obs, _ = make_observer(clock, AccessLogConfig(enabled=False), registry=registry)
    caplog.set_level(logging.INFO, logger="proxy.hotspots")
    feed_fleet(obs, clock, windows=12, backends=FLEET)
    feed_fleet(obs, clock, windows=4, backends=FLEET, stalled="gpu-2", stall_from=0, stall_to=4,
               error_backend="gpu-2", error_rate=0.15, seed=1)
    data = obs.hotspots()
    assert data["backends"]["gpu-2"][LATENCY_HOT_SPOT] and data["backends"]["gpu-2"][SPREADING_ANOMALY]
    assert not any(data["backends"][b][LATENCY_HOT_SPOT] for b in ("gpu-0", "gpu-1", "gpu-3"))
    enters = [r for r in caplog.records if getattr(r, "event", None) == "hotspot_enter"]
    assert {(r.backend, r.state) for r in enters} == {("gpu-2", LATENCY_HOT_SPOT), ("gpu-2", SPREADING_ANOMALY)}
    assert all(r.levelno == logging.WARNING for r in enters)
    assert "backend gpu-2 is a latency hot spot" in enters[0].getMessage()
    exposition = generate_latest(registry).decode()
    assert 'affinity_proxy_backend_hotspot{backend="gpu-2",state="latency_hot_spot"} 1.0' in exposition
    assert 'affinity_proxy_backend_hotspot{backend="gpu-0",state="latency_hot_spot"} 0.0' in exposition
    heat = obs.heatmap()
    assert heat["backends"] == list(FLEET) and len(heat["windows"]) == 90
    row = heat["marks"][2]
    assert row[-5:-1] == ["over", "over", "spreading", "spreading"]  # last four closed windows; open one last
    assert all(m is None for r in (heat["marks"][0], heat["marks"][1], heat["marks"][3]) for m in r)
    assert heat["metrics"]["ttft_p99"][2][-2] > 5 * heat["metrics"]["ttft_p99"][0][-2]
    assert heat["metrics"]["load_score"][2][-2] == 0.9 and heat["metrics"]["inflight"][2][-2] == 12
    assert set(heat["routing_mix"]) <= {"prefix_hit", "exact_hit", "hash", "overload_fallback"}
    # recovery: two normal windows clear both states, with INFO lines
    feed_fleet(obs, clock, windows=3, backends=FLEET, seed=2)
    assert not obs.hotspots()["backends"]["gpu-2"][LATENCY_HOT_SPOT]
    leaves = [r for r in caplog.records if getattr(r, "event", None) == "hotspot_leave"]
    assert {r.state for r in leaves} == {LATENCY_HOT_SPOT, SPREADING_ANOMALY}
    assert 'affinity_proxy_backend_hotspot{backend="gpu-2",state="latency_hot_spot"} 0.0' in \
        generate_latest(registry).decode()


def test_windows_close_without_traffic_and_unrouted_requests_count_apart():
    clock = Clock(1_800_000_005.0)
    obs, _ = make_observer(clock, AccessLogConfig(enabled=False), hotspots=HotspotConfig(history_windows=6))
    obs.on_finish(record(1, backend=None, status=503))
    obs.on_finish(record(2))
    clock.now += 25
    heat = obs.heatmap()
    assert heat["windows"][-1] == int(clock.now // 10) and heat["metrics"]["requests"][0][-4:] == [1, None, None, None]
    assert obs._ring.window(heat["windows"][-4]).unrouted == 1


def test_workers_hand_windows_to_an_aggregator_that_judges_the_merged_fleet():
    clock = Clock(1_800_000_000.0)
    workers = [make_observer(clock, AccessLogConfig(enabled=False), role="worker")[0] for _ in range(2)]
    agg, _ = make_observer(clock, AccessLogConfig(enabled=False), role="aggregator")
    for k in range(16):
        slow = k >= 12
        for w, obs in enumerate(workers):
            for j in range(3):  # 3 per worker and backend: below min_requests=5 alone, 6 once merged
                for b in FLEET:
                    ttft = 0.1 * (10 if slow and b == "gpu-1" else 1) * (1 + 0.05 * j)
                    clock.now = 1_800_000_000.0 + k * 10 + j + w * 0.1
                    obs.on_finish(record(j, backend=b, ttft=ttft))
        clock.now = 1_800_000_000.0 + (k + 1) * 10 + 0.5
        agg.ingest([obs.take_closed() for obs in workers])
    status = agg.hotspots()["backends"]
    assert status["gpu-1"][LATENCY_HOT_SPOT] and not status["gpu-0"][LATENCY_HOT_SPOT]
    assert not any(o.hotspots()["backends"] for o in workers)  # workers judge nothing
    heat = agg.heatmap()
    assert heat["metrics"]["requests"][0][-2] == 6  # both workers' requests in one cell


def simulate(obs, clock, seconds: float, rate_per_backend: float, stall: tuple[str, float, float] | None,
             seed: int = 0) -> list:
    """Requests in virtual time: on_pick at arrival, ttft_s set at the first byte, on_finish at the end; a
    stalled backend answers nothing between `stall[1]` and `stall[2]` (as sim/ faults' stall_ms does), and
    the Observer is ticked every second as `Observer.run` does."""
    import heapq
    import random

    from proxy.observability.record import RequestRecord

    rng = random.Random(seed)
    t0 = clock.now
    events: list = []
    n = 0
    for b in FLEET:
        t = t0
        while t < t0 + seconds:
            t += rng.expovariate(rate_per_backend)
            ttft = 0.12 * rng.lognormvariate(0, 0.3)
            first = t + ttft
            if stall and b == stall[0] and t0 + stall[1] - 1 < first and t < t0 + stall[2]:
                first = max(first, t0 + stall[2]) + ttft  # nothing until the stall ends
            rec = RequestRecord(request_id=f"r{n}", backend=b, reason="hash", status=200)
            heapq.heappush(events, (t, n, "pick", rec, first))
            n += 1
    tick = t0 + 1
    while events:
        t, k, kind, rec, first = heapq.heappop(events)
        while tick <= t:
            clock.now = tick
            obs.tick()
            tick += 1
        clock.now = t
        if kind == "pick":
            obs.on_pick(rec)
            heapq.heappush(events, (first, k, "first", rec, first))
        elif kind == "first":
            rec.ttft_s = first - rec.started
            heapq.heappush(events, (first + 0.3, k, "finish", rec, first))
        else:
            rec.duration_s = t - rec.started
            obs.on_finish(rec)
    return list(obs.events)


def test_a_stall_that_finishes_nothing_is_a_hot_spot_during_the_stall():
    clock = Clock(1_800_000_000.0)
    obs, _ = make_observer(clock, AccessLogConfig(enabled=False))
    simulate(obs, clock, 120, rate_per_backend=3.0, stall=None)
    assert list(obs.events) == []
    stall_start = clock.now + 5
    stall_window = int(stall_start // 10)
    events = simulate(obs, clock, 90, rate_per_backend=3.0, stall=("gpu-2", 5, 45), seed=1)  # 40 s stall
    enter = [e for e in events if e.entered]
    assert [(e.backend, e.state) for e in enter] == [("gpu-2", LATENCY_HOT_SPOT)]
    # 3 windows after the stall began (the first one partly stalled), long before the stall ends
    assert enter[0].window - stall_window <= 3
    assert enter[0].window * 10 + 10 < stall_start + 40
    leave = [e for e in events if not e.entered]
    assert [(e.backend, e.state) for e in leave] == [("gpu-2", LATENCY_HOT_SPOT)]
    assert leave[0].window * 10 > stall_start + 40  # cleared after it recovered
    heat = obs.heatmap()
    row = heat["marks"][FLEET.index("gpu-2")]
    assert row.count("hot") >= 3
    assert max(x for x in heat["metrics"]["waiting"][FLEET.index("gpu-2")] if x) > 50  # requests piled up
    assert obs._pending == {}  # every finished request left the pending table


def test_pending_requests_never_finished_are_forgotten():
    clock = Clock(1_800_000_000.0)
    obs, _ = make_observer(clock, AccessLogConfig(enabled=False), hotspots=HotspotConfig(history_windows=6))
    from proxy.observability.record import RequestRecord

    obs.on_pick(RequestRecord(request_id="lost", backend="gpu-0"))
    obs.on_finish(record(1))
    clock.now += 45
    obs.tick()
    assert len(obs._pending) == 1
    clock.now += 30
    obs.tick()
    assert obs._pending == {}
