"""The runtime's doors: hot reload keeps unchanged arms' state, the pin header, /admin/experiments, config."""

from __future__ import annotations

import dataclasses
from typing import AsyncIterator

import aiohttp
import pytest

from proxy.app import AffinityProxy
from proxy.config import ConfigError, parse_config
from sim.fleet import Fleet, start_fleet
from tests.experiments.helpers import admin_json, conversations, proxy_yaml, run_turns, send

ARMS = """  definitions:
    - name: knobs
      control: base
      arms:
        - {name: base, routing: {policy: affinity}}
        - {name: eps, share: 0.5, routing: {policy: affinity, affinity: {epsilon: %s}}}
"""


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    f = await start_fleet(2, host="127.0.0.1", port=0, speed=50.0)
    yield f
    await f.stop()


async def test_reload_keeps_the_state_of_arms_whose_settings_did_not_change(fleet: Fleet) -> None:
    model = fleet.servers[0].backend.engine.model_name
    proxy = AffinityProxy(parse_config(proxy_yaml(fleet, ARMS % "0.5")))
    await proxy.start()
    try:
        await run_turns(proxy.http_url, model, conversations(40, 2))
        rt = proxy.experiments
        base, eps = rt.arm("knobs", "base"), rt.arm("knobs", "eps")
        before = (base.stats.requests, eps.stats.requests)
        assert all(n > 0 for n in before)
        new = parse_config(proxy_yaml(fleet, ARMS % "0.75"))
        new = dataclasses.replace(new, listen=proxy.config.listen, admin=proxy.config.admin)
        proxy.resilience.apply_config(new)
        assert rt.arm("knobs", "base") is base and base.policy is not None and base.stats.requests == before[0]
        fresh = rt.arm("knobs", "eps")
        assert fresh is not eps and fresh.stats.requests == 0
        assert fresh.policy is not None and fresh.config.routing is not None
        assert fresh.config.routing.affinity.epsilon == 0.75
        # an experiment removed by a reload takes no more requests
        proxy.resilience.apply_config(dataclasses.replace(new, experiments=dataclasses.replace(new.experiments, definitions=())))
        assert not rt.active and (await admin_json(proxy.admin_url))["experiments"] == []
    finally:
        await proxy.stop()


async def test_pin_header_needs_the_admin_token_when_one_is_configured(fleet: Fleet) -> None:
    model = fleet.servers[0].backend.engine.model_name
    text = proxy_yaml(fleet, ARMS % "0.5").replace("admin: {host: 127.0.0.1, port: 0}",
                                                   "admin: {host: 127.0.0.1, port: 0, token: s3cret}")
    proxy = AffinityProxy(parse_config(text))
    await proxy.start()
    try:
        convs = conversations(20, 1)
        async with aiohttp.ClientSession() as s:
            refused = await send(s, proxy.http_url, model, convs[0], 0, headers={"x-affinity-arm": "knobs/eps"})
            assert refused.status == 403
            async with s.post(proxy.http_url + "/v1/chat/completions", headers={"x-affinity-arm": "nope",
                              "x-affinity-arm-token": "s3cret"}, json={"model": model, "messages": [
                                  {"role": "user", "content": "x"}]}) as resp:
                assert resp.status == 400
                assert "no arm 'nope'" in (await resp.json())["error"]["message"]
            for conv in convs:
                r = await send(s, proxy.http_url, model, conv, 0,
                               headers={"x-affinity-arm": "knobs/eps", "x-affinity-arm-token": "s3cret"})
                assert r.status == 200
            async with s.post(proxy.http_url + "/v1/chat/completions", json={"model": model, "messages": [
                    {"role": "user", "content": "which arm?"}]}) as resp:
                assert resp.status == 200
                assert resp.headers["x-affinity-arm"] in ("knobs/base", "knobs/eps")  # debug_headers: true
        data = await admin_json(proxy.admin_url)
        arms = {a["name"]: a for a in data["experiments"][0]["arms"]}
        assert arms["eps"]["totals"]["requests"] + arms["base"]["totals"]["requests"] == 21
        assert arms["eps"]["totals"]["requests"] >= 20
    finally:
        await proxy.stop()


def test_config_names_unknown_group_backends_at_their_line(fleet: Fleet) -> None:
    text = proxy_yaml(fleet, """  definitions:
    - name: c
      control: s
      arms:
        - {name: s}
        - {name: k, share: 0.1, backends: [gpu-404]}
""")
    with pytest.raises(ConfigError, match=r"experiments.definitions\[0\].arms\[1\].backends \(line \d+\): unknown backend 'gpu-404'"):
        parse_config(text)
