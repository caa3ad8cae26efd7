"""`affinity-proxy run --workers 2`: both worker processes assign every conversation to the same arm.

The arms are canary backend groups here, so the backend that answered (debug header) tells the arm of each
request; each request goes on a fresh connection, so the kernel spreads a conversation's turns over both
workers. The supervisor's merged /metrics counts each arm's requests exactly.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import AsyncIterator

import pytest

from proxy.config import parse_config
from proxy.core.experiments import assign, assignment_key, assignment_point, experiment_seed
from proxy.core.request import summary_from_openai
from sim.fleet import Fleet, start_fleet
from tests.deploy.procs import AFFINITY_PROXY, owner_of_connection, post_json, start_proxy
from tests.experiments.helpers import body, conversations, proxy_yaml, sample, scrape

GROUPS = """  definitions:
    - name: build-ab
      control: stable
      arms:
        - {{name: stable}}
        - {{name: canary, share: 0.5, backends: [{canary}]}}
"""


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    f = await start_fleet(4, host="127.0.0.1", port=0, speed=50.0)
    yield f
    await f.stop()


async def test_both_workers_assign_identically(tmp_path: Path, fleet: Fleet) -> None:
    canary = [s.name for s in fleet.servers[2:]]
    text = proxy_yaml(fleet, GROUPS.format(canary=", ".join(canary)))
    cfg = tmp_path / "config.yaml"
    cfg.write_text(text)
    exp = parse_config(text).experiments.definitions[0]
    seed = experiment_seed(exp.name)
    model = fleet.servers[0].backend.engine.model_name
    proxy = await start_proxy([AFFINITY_PROXY, "run", "--config", str(cfg), "--workers", "2"])
    try:
        workers = proxy.workers()
        assert len(workers) == 2
        served_by: dict[int, set[int]] = defaultdict(set)
        per_arm: dict[str, int] = defaultdict(int)
        for conv in conversations(40, 3):
            summary = summary_from_openai("/v1/chat/completions", body(model, conv, 0))
            arm = assign(exp, {"canary": 0.5}, assignment_point(assignment_key(summary), seed))
            for turn in range(conv.turns):
                owner: list[int | None] = []
                reply = await post_json(proxy.port, "/v1/chat/completions", body(model, conv, turn),
                                        lambda r: owner.append(owner_of_connection(r.local_port, proxy.port, workers)))
                assert reply.status == 200, reply.body
                assert owner[0] in workers
                served_by[conv.index].add(owner[0])  # type: ignore[arg-type]  # checked just above
                in_canary = reply.headers["x-affinity-backend"] in canary
                assert in_canary == (arm == "canary"), (conv.index, turn, owner[0], reply.headers)
                per_arm[arm] += 1
        assert any(len(w) == 2 for w in served_by.values())  # conversations really crossed workers
        assert 0 < per_arm["canary"] < 120
        m = await scrape(proxy.admin)
        for arm, n in per_arm.items():
            assert sample(m, "affinity_proxy_experiment_requests_total", experiment="build-ab", arm=arm) == n
    finally:
        assert await proxy.terminate() == 0
