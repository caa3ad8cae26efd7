"""KV-event subscriptions for backends that DNS discovery adds (issue 13): the service's entry in
`telemetry.kv_events.backends` is a template (`tcp://{host}:PORT`) that every address it resolves to fills
in, so a pod that joins is subscribed and its continuations are routed by what its engine really holds; a
pod that leaves loses its subscription and its index. In one process (a fake resolver) and in every
worker of `run --workers 2` (the real resolver, `localhost`)."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import aiohttp
import pytest

from proxy.app import AffinityProxy
from proxy.config import ConfigError, parse_config
from sim.fleet import Fleet, start_fleet
from sim.kv_events import KVEventsConfig
from sim.tokenizer import TOKENIZER_DIR, token_ids

from .test_kv_events_e2e import _continuations_reach_holders, _direct, _until, _words


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    cfg = KVEventsConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    f = await start_fleet(2, speed=20.0, kv_events=cfg)
    yield f
    await f.stop()


def _ports(fleet: Fleet, i: int) -> tuple[int, int, int]:
    """(HTTP, PUB, replay) ports of server i."""
    s = fleet.servers[i]
    pub = s.backend.kv_publisher
    assert pub is not None and pub.endpoint and pub.replay_endpoint
    return (int(s.url.rsplit(":", 1)[1]), int(pub.endpoint.rsplit(":", 1)[1]),
            int(pub.replay_endpoint.rsplit(":", 1)[1]))


def _config(fleet: Fleet, hosts: list[str], extra: str = "") -> str:
    model = fleet.servers[0].backend.engine.model_name
    lines, kv = [], []
    for i, host in enumerate(hosts):
        http, pub, replay = _ports(fleet, i)
        lines.append(f"  - {{name: gpu-{i}, url: 'http://{host}:{http}', models: ['{model}']}}")
        kv.append(f"      gpu-{i}: {{endpoint: 'tcp://{{host}}:{pub}', replay_endpoint: 'tcp://{{host}}:{replay}'}}")
    return (
        "listen: {host: 127.0.0.1, port: 0}\nadmin: {host: 127.0.0.1, port: 0}\ndebug_headers: true\n"
        "health_checks: {enabled: false}\nrouting: {policy: affinity}\n"
        f"discovery: {{enabled: true, interval_ms: 50}}\n{extra}"
        f"backends:\n{chr(10).join(lines)}\n"
        f"telemetry:\n  interval_ms: 100\n  timeout_ms: 80\n  kv_events:\n    stale_after_s: 0\n"
        f"    tokenizers: {{'{model}': '{TOKENIZER_DIR}'}}\n    backends:\n{chr(10).join(kv)}\n"
    )


async def test_a_discovered_backend_is_subscribed_and_routed_by_its_events(fleet: Fleet) -> None:
    model = fleet.servers[0].backend.engine.model_name
    hosts = [f"gpu-{i}.test.svc" for i in range(2)]
    proxy = AffinityProxy(parse_config(_config(fleet, hosts)))
    answers = {h: ["127.0.0.1"] for h in hosts}

    async def resolver(host: str, port: int) -> list[str]:
        return answers[host]

    assert proxy.resilience.discovery is not None and proxy.kv_events is not None and proxy.precise is not None
    proxy.resilience.discovery.resolver = resolver
    index, sub = proxy.precise.index, proxy.kv_events
    names = [f"gpu-{i}@127.0.0.1:{_ports(fleet, i)[0]}" for i in range(2)]
    await proxy.start()
    try:
        await _until(lambda: all(n in proxy.store.current for n in names))
        # Each discovered pod has its own subscription, at its own address (the service names none itself).
        await _until(lambda: sorted(sub.feeds()) == names)
        assert sub._feeds[names[1]].config.endpoint == f"tcp://127.0.0.1:{_ports(fleet, 1)[1]}"
        await asyncio.sleep(0.5)  # SUB sockets connect; what they miss meanwhile comes back by replay
        async with aiohttp.ClientSession() as s:
            prompts = {}
            for i in range(2):  # placed on the engines directly, behind the proxy's back
                for j in range(3):
                    prompts[(i, j)] = p = _words(700 + 10 * i + j, 320)  # 20 blocks of 16 tokens
                    await _direct(s, fleet, i, p)
            await _until(lambda: all(index.match(token_ids(p), model).get(names[i], 0) >= 304
                                     for (i, _), p in prompts.items()))
            for (i, j), p in prompts.items():
                body = {"model": model, "prompt": p + " " + _words(7100 + 10 * i + j, 40), "max_tokens": 1}
                async with s.post(proxy.http_url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    assert resp.headers["x-affinity-backend"] == names[i], (i, j)
                    data = await resp.json()
                    assert data["usage"]["prompt_tokens_details"]["cached_tokens"] >= 304
        assert proxy.metrics.registry.get_sample_value("affinity_proxy_kv_index_blocks", {"backend": names[0]}) > 0

        # gpu-0's pod moves: the old address drains and leaves, and with it its subscription and its index;
        # the new address is subscribed at its own host.
        answers[hosts[0]] = ["127.0.0.2"]
        moved = f"gpu-0@127.0.0.2:{_ports(fleet, 0)[0]}"
        await _until(lambda: names[0] not in proxy.store.current)
        assert names[0] not in sub.feeds() and names[0] not in index.tracked()
        assert names[0] not in sub._tasks
        assert sorted(sub.feeds()) == sorted([moved, names[1]])
        assert sub._feeds[moved].config.endpoint == f"tcp://127.0.0.2:{_ports(fleet, 0)[1]}"
        assert index.state(moved) == "stale"  # nobody publishes there: unknown, never "empty"
    finally:
        await proxy.stop()


def test_a_discovered_service_must_template_its_endpoint(fleet: Fleet) -> None:
    """Every pod of a service publishing on one fixed address would be a wrong index: refused."""
    text = _config(fleet, ["gpu-0.test.svc", "gpu-1.test.svc"]).replace("'tcp://{host}:", "'tcp://127.0.0.1:", 1)
    with pytest.raises(ConfigError) as exc:
        parse_config(text)
    assert any("telemetry.kv_events.backends.gpu-0.endpoint" in e and "{host}" in e for e in exc.value.errors)
    with pytest.raises(ConfigError) as exc:
        parse_config(_config(fleet, ["127.0.0.1", "127.0.0.1"]).replace("gpu-1: {endpoint", "gpu-9: {endpoint"))
    assert any("gpu-9" in e and "names no backend" in e for e in exc.value.errors)


async def test_every_worker_subscribes_to_a_discovered_backend(tmp_path, fleet: Fleet) -> None:
    """`run --workers 2` with the system resolver (`localhost`): the supervisor's discovery adds the pods,
    each worker follows the snapshots it is sent and subscribes, so a continuation that the kernel hands to
    either worker goes to the engine that computed its prefix."""
    from tests.deploy.procs import AFFINITY_PROXY, start_proxy

    model = fleet.servers[0].backend.engine.model_name
    cfg = tmp_path / "config.yaml"
    cfg.write_text(_config(fleet, ["localhost", "localhost"]))
    names = [f"gpu-{i}@127.0.0.1:{_ports(fleet, i)[0]}" for i in range(2)]
    proxy = await start_proxy([AFFINITY_PROXY, "run", "--config", str(cfg), "--workers", "2"])
    try:
        workers = proxy.workers()
        assert len(workers) == 2
        # Discovery's first view reaches both workers, each subscribes to both pods (its log says so).
        subscribed = f"subscriptions now {names!r}".replace('"', "'")
        await _until(lambda: sum(subscribed in line for line in proxy.log) == 2, timeout=20)
        await asyncio.sleep(0.5)  # SUB sockets connect; what they miss meanwhile comes back by replay
        async with aiohttp.ClientSession() as s:
            prompts = {}
            for i in range(2):
                for j in range(3):
                    prompts[(i, j)] = p = _words(800 + 10 * i + j, 320)
                    await _direct(s, fleet, i, p)
        await asyncio.sleep(1.5)  # every worker has applied the events (or replayed them)
        await _continuations_reach_holders(proxy.port, model, prompts, names, workers, 9100)
    finally:
        await proxy.terminate()
