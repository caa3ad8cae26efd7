"""Per-arm measurement: the sliding window, percentiles, usage parsing, error kinds; PromQL readings."""

from __future__ import annotations

import json

import pytest
from aiohttp import web

from proxy.core.decision import Outcome
from proxy.core.experiments import ArmConfig, ExperimentConfig, ExperimentsConfig, GuardrailConfig
from proxy.core.registry import build_policy
from proxy.experiments.runtime import ExperimentRuntime
from proxy.experiments.window import ArmStats, error_kind, usage_of


def test_window_forgets_old_buckets_and_interpolates_p99() -> None:
    s = ArmStats(window_s=3.0)
    for i in range(99):
        s.observe(10.0, 200, None, 0.1, 0.05, (100, 40))
    s.observe(10.5, 500, Outcome.STATUS_5XX, 0.2, 0.01, None)
    s.observe(10.5, 200, None, 2.0, 1.0, (100, 0))
    w = s.window(11.0)
    assert (w.requests, w.errors, w.prompt_tokens, w.cached_tokens) == (101, 1, 10000, 3960)
    assert w.error_rate == pytest.approx(1 / 101)
    assert 0.045 < w.ttft_p99 < 0.06  # type: ignore[operator]  # not None: there are samples
    assert w.hit_ratio == pytest.approx(0.396)
    assert s.window(13.9).requests == 101
    assert s.window(14.0).requests == 0  # every bucket is older than 3 s
    assert s.requests == 101 and s.errors == {"5xx": 1}  # totals stay
    later = s.window(14.0)
    assert later.ttft_p99 is None and later.error_rate is None


def test_error_kinds_and_usage() -> None:
    assert error_kind(200, None) is None and error_kind(499, None) is None and error_kind(429, None) is None
    assert error_kind(503, None) == "5xx" and error_kind(200, Outcome.STATUS_5XX) == "5xx"
    assert error_kind(502, Outcome.CONNECT_FAILURE) == "connect_failure"
    assert error_kind(200, Outcome.STREAM_FAILURE) == "stream_failure"
    body = json.dumps({"choices": [{"text": "usage"}], "usage": {
        "prompt_tokens": 12, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 8}}}).encode()
    assert usage_of(body) == (12, 8)
    assert usage_of(json.dumps({"usage": {"prompt_tokens": 5}}).encode()) == (5, 0)
    assert usage_of(b'{"usage": null}') is None and usage_of(b"not json") is None and usage_of(None) is None


async def test_promql_readings_and_failures(aiohttp_server: object) -> None:
    answers = {"good": {"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": {}, "value": [0, "0.07"]}]}},
        "empty": {"status": "success", "data": {"resultType": "vector", "result": []}},
        "nan": {"status": "success", "data": {"resultType": "vector", "result": [{"metric": {}, "value": [0, "NaN"]}]}}}
    asked: list[str] = []

    async def query(request: web.Request) -> web.Response:
        q = request.query["query"]
        asked.append(q)
        arm = q.split("arm=")[1]
        return web.json_response(answers["good" if arm == "cand" else "empty"])

    app = web.Application()
    app.router.add_get("/api/v1/query", query)
    server = await aiohttp_server(app)  # type: ignore[operator]  # the pytest-aiohttp fixture
    url = str(server.make_url(""))
    cfg = ExperimentsConfig(definitions=(ExperimentConfig(
        name="e", control="ctl", arms=(ArmConfig("ctl"), ArmConfig("cand", share=0.5)),
        guardrails=(GuardrailConfig("errs > 0.05", factor=0.5, source="prometheus", prometheus_url=url,
                                    query="q{experiment} arm={arm}"),)),))
    rt = ExperimentRuntime(cfg, build_policy=build_policy)
    try:
        actions = await rt.evaluate_once()
        assert [(a.kind, a.new_weight) for a in actions] == [("cut", 0.25)]
        assert "errs 0.07 vs bound 0.05" in actions[0].reasons[0]
        assert sorted(asked) == ["qe arm=cand", "qe arm=ctl"]
        assert rt.as_json()["experiments"][0]["history"][0]["action"] == "cut"
        answers["empty"] = answers["nan"]
        assert await rt.query(url, "x arm=ctl") is None  # NaN is no reading
        assert rt.query_errors == 0
        assert await rt.query("http://127.0.0.1:1", "up") is None
        assert rt.query_errors == 1
    finally:
        await rt.stop()
