"""A tiny live run through the real proxy to a 2-server simulated fleet, and a tiny offline replay."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import AsyncIterator

import pytest

from loadtest.replay import ReplayConfig, replay
from loadtest.report import summarize
from loadtest.records import RunConfig
from loadtest.run import run_workload
from sim.fleet import Fleet, start_fleet
from sim.profiles import get_profile
from loadtest.workloads import Workload, load_workload
from proxy.app import AffinityProxy
from proxy.config import parse_config

MODEL = "llama3-8b"


def small_workload() -> Workload:
    """40 requests over a few shared system prompts, short enough for a test (and for Llama-3's 8k)."""
    return load_workload(
        "sysprompt:requests=40,rate=40,system_prompts=2,system_tokens=600-900,users=8,question_tokens=20-60,"
        "answer_tokens=4-12",
        seed=5,
    )


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    f = await start_fleet(2, host="127.0.0.1", port=0, speed=4.0, model_name=MODEL)
    yield f
    await f.stop()


async def test_live_run_through_the_proxy(fleet: Fleet) -> None:
    backends = "\n".join(f"  - {{name: {s.name}, url: '{s.url}'}}" for s in fleet.servers)
    cfg = parse_config(
        "listen: {port: 0}\nadmin: {port: 0}\ndebug_headers: true\nhealth_checks: {enabled: false}\n"
        f"routing: {{policy: affinity}}\nbackends:\n{backends}\n"
    )
    proxy = AffinityProxy(cfg)
    await proxy.start()
    try:
        w = small_workload()
        res = await run_workload(
            w, RunConfig(url=proxy.http_url, model=MODEL, speed=4.0, progress=False, label="affinity"),
            metrics_urls={s.name: s.url + "/metrics" for s in fleet.servers},
        )
    finally:
        await proxy.stop()
    assert len(res.records) == 40
    assert all(r.status == 200 and r.error is None for r in res.records), [r.error for r in res.records if r.error]
    assert {r.backend for r in res.records} <= {s.name for s in fleet.servers}
    assert all(r.output_tokens == w.items[r.index].output_tokens for r in res.records)  # ignore_eos honoured
    s = summarize(res, w)
    assert s["hit_ratio"] is not None and s["hit_ratio"] > 0.3  # long shared system prompts hit
    assert s["bound_inf"] is not None and s["hit_ratio"] <= s["bound_inf"] + 0.05
    assert s["gpu_util_mean"] is not None and s["capacity_tokens"] == 2 * get_profile("llama3-8b-h100").kv_capacity_tokens
    # The simulators' own lateness against their engine model (sim/metrics.py), which only a live run has.
    assert s["sim_late_mean_ms"] >= 0.0 and s["sim_late_max_ms"] >= s["sim_late_mean_ms"]


async def test_replay_is_deterministic_and_affinity_keeps_more_cache() -> None:
    w = small_workload()
    w = Workload(w.name, [replace(it, t=it.t * 4) for it in w.items], w.block_tokens, w.namespace)  # sparser
    base = ReplayConfig(backends=2, speed=1.0, max_model_len=None)
    rr = await replay(w, replace(base, policy="round_robin"))
    aff = await replay(w, replace(base, policy="affinity"))
    again = await replay(w, replace(base, policy="affinity"))
    assert [r.ttft for r in aff.records] == [r.ttft for r in again.records]  # virtual time: exact repeat
    assert all(r.status == 200 and r.ttft is not None and r.ttft > 0 for r in aff.records)
    s_rr, s_aff = summarize(rr, w), summarize(aff, w)
    assert s_rr["requests"] == s_aff["requests"] == 40
    assert "sim_late_mean_ms" not in s_aff  # virtual time is never late
    assert s_aff["hit_ratio"] >= s_rr["hit_ratio"]
    assert sum(aff.meta["reasons"].values()) == 40
    await asyncio.sleep(0)


async def test_the_replays_proxy_reads_every_virtual_backends_metrics(caplog: pytest.LogCaptureFixture) -> None:
    """The replay's poller scrapes the virtual backends' /metrics, rendered by the simulator's own code
    (sim/metrics.py): a series the virtual backend cannot render fails every scrape, and the replay routes
    without the engines' telemetry (it happened once: the simulator's lateness series)."""
    w = small_workload()
    with caplog.at_level(logging.DEBUG, logger="affinity_proxy.telemetry"):
        res = await replay(w, ReplayConfig(backends=2, speed=1.0, max_model_len=None, policy="least_load"))
    assert len(res.records) == 40
    assert not [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
