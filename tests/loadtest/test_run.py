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


def test_the_proxys_cpu_counts_its_live_workers() -> None:
    """`run --workers N` is a supervisor whose workers do the work: a parent's cutime counts a child only once
    it is reaped, so the CPU of a live worker must be read from the worker itself."""
    import subprocess
    import sys

    from loadtest.run import process_cpu_seconds

    burn = ("import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\n"
            "print('burnt', flush=True)\ntime.sleep(60)\n")
    # The parent spawns the burner and waits on it (spends no CPU of its own while it does).
    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys\n"
         f"p = subprocess.Popen([sys.executable, '-c', {burn!r}])\np.wait()\n"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None and parent.stdout.readline().strip() == "burnt"
        cpu = process_cpu_seconds([parent.pid])
        assert cpu is not None and cpu >= 0.4  # the parent alone has spent well under that
    finally:
        import os
        import signal

        for child in Path(f"/proc/{parent.pid}/task/{parent.pid}/children").read_text().split():
            os.kill(int(child), signal.SIGKILL)
        parent.wait(10)
    assert process_cpu_seconds([parent.pid]) is None  # gone: unreadable, not zero


def test_the_report_reads_the_engines_own_ttft_against_the_clients() -> None:
    """The engines' TTFT histograms (sum and count, per backend, first to last sample) against the client's
    TTFT: what the path in between added on average."""
    from loadtest.records import Record

    recs = [Record(index=i, sent=0.1 * i, scheduled=0.1 * i, input_tokens=100, status=200, ttft=t, e2e=t + 0.1,
                   output_tokens=2, backend=b)
            for i, (t, b) in enumerate([(0.30, "a"), (0.50, "a"), (0.40, "b")])]
    samples = [
        {"t": 0.0, "backend": "a", "ttft_sum": 1.0, "ttft_count": 5.0},
        {"t": 9.0, "backend": "a", "ttft_sum": 1.7, "ttft_count": 7.0},  # 0.25 + 0.45
        {"t": 0.0, "backend": "b", "ttft_sum": None, "ttft_count": None},
        {"t": 9.0, "backend": "b", "ttft_sum": 0.35, "ttft_count": 1.0},
    ]
    s = summarize(RunResult({}, recs, samples, {}, 9.0))
    assert s["engine_ttft_mean"] == pytest.approx(1.05 / 3)
    assert s["ttft_added_mean_ms"] == pytest.approx(1000 * (1.2 - 1.05) / 3)
    # An engine that answered a request the client did not count (or missed one): no difference claimed.
    samples[-1]["ttft_count"] = 2.0
    s = summarize(RunResult({}, recs, samples, {}, 9.0))
    assert s["engine_ttft_mean"] == pytest.approx(1.05 / 4) and s["ttft_added_mean_ms"] is None
    # No engine histogram at all: neither field.
    s = summarize(RunResult({}, recs, [{"t": 0.0, "backend": "a"}, {"t": 9.0, "backend": "a"}], {}, 9.0))
    assert "engine_ttft_mean" not in s
