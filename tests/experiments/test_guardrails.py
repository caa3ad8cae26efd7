"""Guardrails through the proxy on the simulator: a 10% 5xx fault on the candidate arm's backends.

The rule `error_rate > 0.02 -> weight x 0.3` must cut the candidate within 2 evaluation windows, the error
share the client sees must fall with it, and once the fault clears the weight must step back up; read from
the proxy's own aggregates, and the same rule read from a real Prometheus scraping the proxy.
"""

from __future__ import annotations

from pathlib import Path
from typing import AsyncIterator

import pytest

from loadtest.guardrail_demo import PROXY_RULE, ScenarioResult, experiment_yaml, promql_rule, proxy_config, run_scenario
from loadtest.prometheus_proc import prometheus_binary, start_prometheus
from proxy.app import AffinityProxy
from sim.fleet import Fleet, start_fleet
from tests.experiments.helpers import sample, scrape
from tests.support import free_port

WINDOW_S = 3.0


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    f = await start_fleet(4, host="127.0.0.1", port=0, speed=50.0)
    yield f
    await f.stop()


def check(result: ScenarioResult, source: str) -> None:
    phases = {p.name: p for p in result.phases}
    # cut within two evaluation windows of the fault
    assert result.marks["cut"] - result.marks["fault"] <= 2 * WINDOW_S, result.marks
    cuts = [h for h in result.history if h["action"] == "cut"]
    assert cuts[0]["old_weight"] == 0.5 and cuts[0]["new_weight"] == pytest.approx(0.15)
    assert all(f"({source})" in h["reasons"][0] for h in cuts)
    assert phases["baseline"].errors == 0
    full, floor = phases["fault, full weight"], phases["fault, at floor"]
    assert full.requests >= 50 and full.error_share > 0.01, full
    # the client's error share falls with the candidate's weight
    assert floor.candidate_share < 0.15, floor
    assert floor.error_share < full.error_share / 2, (full, floor)
    # after the fault clears the weight steps back up
    restores = [h for h in result.history if h["action"] == "restore"]
    assert restores and restores[0]["old_weight"] == pytest.approx(0.05) and restores[0]["new_weight"] > 0.05
    assert phases["restored"].errors == 0


async def test_guardrail_cuts_on_errors_and_restores(fleet: Fleet) -> None:
    candidate = [s.name for s in fleet.servers[2:]]
    proxy = AffinityProxy(proxy_config(fleet, experiment_yaml(candidate, rule=PROXY_RULE, window_s=WINDOW_S)))
    await proxy.start()
    try:
        result = await run_scenario(fleet, proxy, candidate)
        check(result, "proxy")
        # every action is a metric too
        m = await scrape(proxy.admin_url)
        assert sample(m, "affinity_proxy_experiment_actions_total", experiment="guard", arm="candidate",
                      action="cut") == 2
        assert sample(m, "affinity_proxy_experiment_errors_total", experiment="guard", arm="candidate",
                      kind="5xx") == sum(1 for s in result.samples if s.status >= 500)
        assert sample(m, "affinity_proxy_experiment_errors_total", experiment="guard", arm="stable", kind="5xx") == 0
    finally:
        await proxy.stop()


@pytest.mark.skipif(prometheus_binary() is None, reason="no prometheus binary (Debian package `prometheus`)")
async def test_the_same_rule_read_from_a_real_prometheus(fleet: Fleet, tmp_path: Path) -> None:
    candidate = [s.name for s in fleet.servers[2:]]
    admin_port = free_port()
    prom = await start_prometheus(f"127.0.0.1:{admin_port}", tmp_path / "prometheus")
    try:
        config = proxy_config(fleet, experiment_yaml(candidate, rule=promql_rule(prom.url), window_s=WINDOW_S),
                              admin_port=admin_port)
        proxy = AffinityProxy(config)
        await proxy.start()
        try:
            result = await run_scenario(fleet, proxy, candidate, timeout_s=40)
            check(result, "prometheus")
            assert proxy.experiments.query_errors == 0
        finally:
            await proxy.stop()
    finally:
        await prom.stop()
