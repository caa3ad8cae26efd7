"""The poller against fake metrics endpoints: signals, scores, staleness, slow backends, ORCA, wiring."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from proxy.control.adapters import ADAPTERS, Reading
from proxy.control.poller import Deriver, Poller
from proxy.control.store import SnapshotStore
from proxy.control.telemetry_config import TelemetryConfig
from proxy.control.telemetry_metrics import TelemetryMetrics
from proxy.core.score import ScoreConfig
from proxy.core.snapshot import BackendSpec, Snapshot
from tests.support import FakeMetrics, agent_page

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "metrics"


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
async def servers() -> AsyncIterator[list[FakeMetrics]]:
    made: list[FakeMetrics] = []
    yield made
    for s in made:
        await s.stop()


async def make_servers(made: list[FakeMetrics], pages: list[str]) -> list[FakeMetrics]:
    for page in pages:
        made.append(await FakeMetrics(page).start())
    return made


def store_for(servers: list[FakeMetrics]) -> SnapshotStore:
    return SnapshotStore(Snapshot.initial(BackendSpec(name=f"b{i}", url=s.url) for i, s in enumerate(servers)))


async def started(store: SnapshotStore, cfg: TelemetryConfig | None = None, **kw: object) -> Poller:
    poller = Poller(store, cfg or TelemetryConfig(), **kw)  # type: ignore[arg-type]  # keyword options of several types
    await poller.open()  # no loop: the tests drive rounds with poll_once
    return poller


async def test_one_round_reads_every_engine(servers: list[FakeMetrics]) -> None:
    names = list(ADAPTERS)
    await make_servers(servers, [(FIXTURES / f"{n}.txt").read_text() for n in names])
    store = store_for(servers)
    poller = await started(store)
    try:
        snap = await poller.poll_once()
    finally:
        await poller.stop()
    assert snap.version == 2
    for i, engine in enumerate(names):
        b = snap.backends[i]
        assert b.signals is not None and b.signals.engine == engine
        assert not b.stale
        assert b.load_score is not None and 0 < b.load_score <= 1
    vllm = snap.backends[names.index("vllm")].signals
    assert vllm is not None and vllm.kernel_queue == 15.0 and vllm.kv_capacity_tokens == 16 * 27910


async def test_score_follows_load_on_the_next_round(servers: list[FakeMetrics]) -> None:
    await make_servers(servers, [agent_page(queue=0), agent_page(queue=0)])
    store = store_for(servers)
    poller = await started(store)
    try:
        first = await poller.poll_once()
        servers[1].page = agent_page(mem_used=76e9, queue=100, kv_rate=512)
        second = await poller.poll_once()
    finally:
        await poller.stop()
    assert first.get("b0").load_score == first.get("b1").load_score == pytest.approx(0.2)
    assert second.get("b1").load_score == pytest.approx(0.4 * 0.95 + 0.35 + 0.25)
    assert second.get("b0").load_score == pytest.approx(0.2)


async def test_stopped_metrics_go_stale_not_idle(servers: list[FakeMetrics]) -> None:
    await make_servers(servers, [agent_page(queue=80), agent_page(queue=80)])
    store = store_for(servers)
    clock = FakeClock()
    reg = CollectorRegistry()
    metrics = TelemetryMetrics(reg)
    cfg = TelemetryConfig(interval_ms=200, stale_after_intervals=3)
    poller = await started(store, cfg, clock=clock, metrics=metrics)
    try:
        snap = await poller.poll_once()
        busy_score = snap.get("b1").load_score
        assert busy_score is not None and busy_score > 0.4
        servers[1].status = 404
        states = []
        for _ in range(4):
            clock.t += 0.19
            snap = await poller.poll_once()
            states.append(snap.get("b1").stale)
    finally:
        await poller.stop()
    # 0.19, 0.38, 0.57 s old: still fresh (limit 3 x 0.2 s); 0.76 s: stale
    assert states == [False, False, False, True]
    b1 = snap.get("b1")
    assert b1.load_score is None  # unknown, never 0 (idle)
    assert b1.signals is not None and b1.signals.kernel_queue == 80  # last values kept for the admin view
    assert not snap.get("b0").stale
    text = generate_latest(reg).decode()
    assert 'affinity_proxy_telemetry_scrape_errors_total{backend="b1",kind="http_4xx"} 4.0' in text


async def test_page_without_known_series_is_an_error(servers: list[FakeMetrics]) -> None:
    await make_servers(servers, ["# TYPE foo gauge\nfoo 1\n"])
    store = store_for(servers)
    reg = CollectorRegistry()
    poller = await started(store, metrics=TelemetryMetrics(reg))
    try:
        snap = await poller.poll_once()
    finally:
        await poller.stop()
    assert snap.backends[0].signals is None and snap.backends[0].stale
    assert 'kind="no_signals"' in generate_latest(reg).decode()


async def test_slow_backend_times_out_alone(servers: list[FakeMetrics]) -> None:
    await make_servers(servers, [agent_page(queue=10), agent_page(queue=20), agent_page(queue=30)])
    servers[1].delay_s = 1.0
    store = store_for(servers)
    reg = CollectorRegistry()
    cfg = TelemetryConfig(interval_ms=200, timeout_ms=100)
    poller = await started(store, cfg, metrics=TelemetryMetrics(reg))
    try:
        snap = await poller.poll_once()
    finally:
        await poller.stop()
    assert snap.get("b0").signals is not None and snap.get("b0").signals.kernel_queue == 10
    assert snap.get("b2").signals is not None and snap.get("b2").signals.kernel_queue == 30
    assert snap.get("b1").signals is None
    assert 'backend="b1",kind="timeout"' in generate_latest(reg).decode()


async def test_unreachable_backend_is_a_connect_error(servers: list[FakeMetrics]) -> None:
    await make_servers(servers, [agent_page()])
    await servers[0].stop()
    store = store_for(servers)
    reg = CollectorRegistry()
    poller = await started(store, metrics=TelemetryMetrics(reg))
    try:
        await poller.poll_once()
    finally:
        await poller.stop()
    assert 'kind="connect"' in generate_latest(reg).decode()


async def test_run_loop_publishes_rounds_and_composes_with_other_writers(servers: list[FakeMetrics]) -> None:
    await make_servers(servers, [agent_page(queue=5)])
    store = store_for(servers)
    cfg = TelemetryConfig(interval_ms=20, timeout_ms=15)
    poller = Poller(store, cfg)
    rounds = asyncio.Event()
    seen: list[int] = []

    def listener(snap: Snapshot) -> None:
        seen.append(snap.version)
        if poller.rounds >= 3:
            rounds.set()

    store.subscribe(listener)
    await poller.start()
    try:
        # another control-plane writer changes the weight between rounds; the poller must keep it
        store.update(lambda s: s.replace_backend("b0", weight=3.0))
        await asyncio.wait_for(rounds.wait(), timeout=10)
    finally:
        await poller.stop()
    b0 = store.current.get("b0")
    assert b0.weight == 3.0 and b0.signals is not None and b0.signals.kernel_queue == 5
    assert seen == sorted(seen)


async def test_orca_header_refreshes_signals_between_scrapes(servers: list[FakeMetrics]) -> None:
    await make_servers(servers, [(FIXTURES / "vllm.txt").read_text()])
    store = store_for(servers)
    poller = await started(store, orca_flush_s=0.0)
    try:
        before = await poller.poll_once()
        published = asyncio.Event()
        store.subscribe(lambda snap: published.set())
        poller.observe_orca("b0", "TEXT named_metrics.num_requests_waiting=90, named_metrics.kv_cache_usage_perc=0.9")
        poller.observe_orca("b0", "BIN Zm9v")  # unreadable formats are ignored
        await asyncio.wait_for(published.wait(), timeout=10)
    finally:
        await poller.stop()
    after = store.current.get("b0")
    assert after.signals is not None
    assert (after.signals.waiting, after.signals.kv_usage, after.signals.kernel_queue) == (90.0, 0.9, 102.0)
    assert after.load_score is not None and after.load_score > (before.get("b0").load_score or 0)


async def test_orca_does_not_revive_a_stale_backend(servers: list[FakeMetrics]) -> None:
    await make_servers(servers, [agent_page()])
    store = store_for(servers)
    clock = FakeClock()
    poller = await started(store, clock=clock)
    try:
        await poller.poll_once()
        servers[0].status = 500
        clock.t += 10
        snap = await poller.poll_once()
        assert snap.backends[0].stale
        snap2 = poller._apply_orca(store.current, {"b0": {"waiting": 1.0}})
    finally:
        await poller.stop()
    assert snap2.backends[0].stale and snap2.backends[0].load_score is None


def test_deriver_rates() -> None:
    d = Deriver()
    s1 = d.signals(Reading(kv_usage=0.1, kv_capacity_tokens=10000, requests_total=100, latency_sum_s=10.0,
                           latency_count=100, busy_seconds_total=50.0), 10.0)
    assert s1.kv_tokens_per_s is None and s1.qps is None and s1.latency_ms is None  # unknown on first sight
    s2 = d.signals(Reading(kv_usage=0.2, kv_capacity_tokens=10000, requests_total=110, latency_sum_s=12.0,
                           latency_count=110, busy_seconds_total=50.1), 10.5)
    assert s2.kv_tokens_per_s == pytest.approx(2000.0)
    assert s2.qps == pytest.approx(20.0)
    assert s2.latency_ms == pytest.approx(200.0)
    assert s2.gpu_utilization == pytest.approx(0.2)
    # KV shrinking is not negative load; no new requests keeps the last latency; a counter reset gives None
    s3 = d.signals(Reading(kv_usage=0.05, kv_capacity_tokens=10000, requests_total=5, latency_sum_s=12.0,
                           latency_count=110), 11.0)
    assert s3.kv_tokens_per_s == 0.0 and s3.qps is None and s3.latency_ms == pytest.approx(200.0)


def test_staleness_must_exceed_one_interval() -> None:
    with pytest.raises(ValueError, match="stale_after_intervals"):
        TelemetryConfig(stale_after_intervals=1.0)
    assert TelemetryConfig().stale_after_s == pytest.approx(0.6)


def test_config_errors_name_their_yaml_line() -> None:
    from proxy.config import ConfigError, parse_config

    with pytest.raises(ConfigError) as err:
        parse_config("telemetry:\n  interval_ms: 100\n  timeout_ms: 150\n  metric_map: {foo: bar}\n")
    text = str(err.value)
    assert "telemetry.timeout_ms (line 3): must be shorter than interval_ms" in text
    assert "telemetry.metric_map (line 4)" in text and "unknown signal 'bar'" in text
    cfg = parse_config("backends: [{name: a, url: 'http://127.0.0.1:1'}]\n"
                       "telemetry:\n  score: {kind: qps_memory, qps_full: 20}\n  metric_map: {q: waiting}\n")
    assert cfg.telemetry.score == ScoreConfig(kind="qps_memory", qps_full=20.0)


async def test_snapshot_collector_exports_per_backend_state(servers: list[FakeMetrics]) -> None:
    await make_servers(servers, [agent_page(queue=50), agent_page()])
    servers[1].status = 503
    store = store_for(servers)
    reg = CollectorRegistry()
    metrics = TelemetryMetrics(reg)
    clock = FakeClock()
    reg.register(type("C", (), {"collect": staticmethod(metrics.snapshot_collector(store, clock))})())
    poller = await started(store, clock=clock, metrics=metrics)
    try:
        await poller.poll_once()
    finally:
        await poller.stop()
    clock.t += 0.25
    text = generate_latest(reg).decode()
    assert 'affinity_proxy_backend_load_score{backend="b0"}' in text
    assert 'affinity_proxy_backend_load_score{backend="b1"}' not in text  # unknown is absent, not 0
    assert 'affinity_proxy_backend_metrics_stale{backend="b1"} 1.0' in text
    assert 'affinity_proxy_backend_metrics_stale{backend="b0"} 0.0' in text
    assert 'affinity_proxy_backend_metrics_age_seconds{backend="b0"} 0.25' in text
    assert 'affinity_proxy_backend_signal{backend="b0",signal="kernel_queue"} 50.0' in text
    assert 'affinity_proxy_backend_health{backend="b0",state="unknown"} 1.0' in text
    assert 'affinity_proxy_backend_weight{backend="b0"} 1.0' in text


async def test_a_malformed_line_costs_only_that_line(servers: list[FakeMetrics]) -> None:
    bad = 'vllm:num_requests_running 1\nvllm:cache_config_info{block_size="16",garbage} 1\n'
    await make_servers(servers, [bad])
    poller = await started(store_for(servers))
    try:
        snap = await poller.poll_once()
    finally:
        await poller.stop()
    s = snap.backends[0].signals
    assert s is not None and s.running == 1.0 and s.kv_capacity_tokens is None


async def test_an_unreadable_page_fails_only_its_backend(servers: list[FakeMetrics]) -> None:
    await make_servers(servers, ["\xff not a page", agent_page(queue=7)])
    store = store_for(servers)
    reg = CollectorRegistry()
    poller = await started(store, metrics=TelemetryMetrics(reg))
    plain = poller._extractor.read

    def read(text: str) -> object:
        if "not a page" in text:
            raise ValueError("unreadable")
        return plain(text)

    poller._extractor = type("E", (), {"read": staticmethod(read)})()  # type: ignore[assignment]  # a stand-in reader
    try:
        snap = await poller.poll_once()
    finally:
        await poller.stop()
    assert snap.get("b0").signals is None
    assert snap.get("b1").signals is not None and snap.get("b1").signals.kernel_queue == 7
    assert 'backend="b0",kind="invalid"' in generate_latest(reg).decode()
