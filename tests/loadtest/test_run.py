"""The load generator and the report against a tiny fake OpenAI server (no simulator, no proxy)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import AsyncIterator

import pytest
from aiohttp import web

from loadtest.report import summarize, write_report
from loadtest.records import RunConfig, RunResult
from loadtest.run import run_workload
from loadtest.workloads import load_workload
from tests.loadtest.fake_openai import STATE, make_app


@pytest.fixture
async def fake() -> AsyncIterator[tuple[str, web.Application]]:
    app = make_app("fake-0", fail_every=7)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}", app
    await runner.cleanup()


async def test_open_loop_records_every_request(fake: tuple[str, web.Application], tmp_path: Path) -> None:
    url, app = fake
    w = load_workload("mix:requests=30,rate=200,long_fraction=0", seed=0)
    w.items = [it.__class__(it.t, it.input_tokens, 5, it.segments) for it in w.items]  # short generations
    res = await run_workload(w, RunConfig(url=url, speed=1.0, progress=False, label="fake"),
                             metrics_urls={"fake-0": url + "/metrics"})
    assert [r.index for r in res.records] == list(range(30))
    ok = [r for r in res.records if r.status == 200]
    failed = [r for r in res.records if r.status == 500]
    assert len(failed) == 30 // 7 and all(f.error for f in failed)
    assert all(r.ttft is not None and r.e2e is not None and r.e2e >= r.ttft for r in ok)
    assert all(r.output_tokens == 5 and r.backend == "fake-0" for r in ok)
    assert res.samples and res.capacity_tokens == {"fake-0": 16000}
    # arrivals follow the trace: the last request was not sent before its scheduled time
    last = max(res.records, key=lambda r: r.scheduled)
    assert last.sent >= last.scheduled - 0.005
    # round trip through JSON, then the report
    path = tmp_path / "run.json"
    res.save(path)
    again = RunResult.load(path)
    s = summarize(again, w)
    assert s["ok"] == len(ok) and s["errors"] == len(failed)
    assert s["hit_ratio"] == pytest.approx(app[STATE]["hits"] / app[STATE]["queries"])
    report = write_report([s], tmp_path / "rep", title="t", workload=w)
    assert "| fake |" in report.read_text()
    assert (tmp_path / "rep" / "report.png").stat().st_size > 0
    assert json.loads((tmp_path / "rep" / "report.json").read_text())["summaries"][0]["label"] == "fake"


async def test_closed_loop_keeps_n_users_busy(fake: tuple[str, web.Application]) -> None:
    url, app = fake
    w = load_workload("lora:requests=12,adapters=2", seed=0)
    res = await run_workload(w, RunConfig(url=url, closed=3, progress=False))
    assert len(res.records) == 12
    assert res.meta["mode"] == "closed:3"
    assert app[STATE]["n"] == 12
