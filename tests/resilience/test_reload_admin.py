"""Hot reload (admin, SIGHUP, file watch) and the admin write endpoints, on a running proxy."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import AsyncIterator

import aiohttp
import pytest

from proxy.app import AffinityProxy
from proxy.config import load_config, parse_config
from proxy.control.reload import Reloader
from proxy.core.snapshot import Health
from tests.support import FakeBackend, established_to, until

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


def config_text(backends: list[FakeBackend], extra: str = "") -> str:
    lines = "\n".join(f"  - {{name: {f.name}, url: '{f.url}'}}" for f in backends)
    return ("listen: {port: 0}\nadmin: {port: 0}\ntelemetry: {enabled: false}\ndebug_headers: true\n"
            "health_checks: {interval_ms: 30, jitter: 0.1}\nrouting: {policy: round_robin}\n"
            f"backends:\n{lines}\n{extra}")


@pytest.fixture
async def running(tmp_path: Path, fakes: list[FakeBackend]) -> AsyncIterator[tuple[AffinityProxy, Path]]:
    path = tmp_path / "proxy.yaml"
    path.write_text(config_text(fakes[:2]))
    proxy = AffinityProxy(load_config(str(path)), config_path=str(path))
    await proxy.start()
    yield proxy, path
    await proxy.stop()


async def test_admin_reload_invalid_keeps_old_config_valid_swaps_backends(running, fakes) -> None:
    proxy, path = running
    admin = proxy.admin_url
    async with aiohttp.ClientSession() as s:
        v0 = proxy.store.current.version
        path.write_text(config_text(fakes[:2], "retries: {max_attempts: 0}\nhealth_checks: {interval_ms: -1}\n"))
        async with s.post(admin + "/admin/reload") as r:
            body = await r.json()
        assert r.status == 422 and not body["ok"]
        assert any("retries.max_attempts (line" in e for e in body["errors"])
        assert proxy.store.current.version == body["version"] >= v0
        assert proxy.resilience.metrics.reloads.labels("invalid")._value.get() == 1
        async with s.get(admin + "/metrics") as r:
            assert "affinity_proxy_config_last_reload_ok 0.0" in await r.text()  # alertable while invalid
        async with s.get(admin + "/admin/reload") as r:
            assert (await r.json())["last"]["ok"] is False
        async with s.post(proxy.http_url + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 200  # the old configuration keeps serving

        fakes[1].hang_stream = True
        held = await s.post(proxy.http_url + "/v1/chat/completions", json={**CHAT, "stream": True})
        if held.headers["x-affinity-backend"] != "b1":
            held.close()
            held = await s.post(proxy.http_url + "/v1/chat/completions", json={**CHAT, "stream": True})
        assert held.headers["x-affinity-backend"] == "b1"
        await held.content.readline()
        path.write_text(config_text([fakes[0], fakes[2]]))
        async with s.post(admin + "/admin/reload") as r:
            body = await r.json()
        assert r.status == 200 and body["ok"] and body["version"] == proxy.store.current.version
        assert proxy.resilience.metrics.reload_ok._value.get() == 1
        snap = proxy.store.current
        assert snap.get("b1").health is Health.DRAINING  # busy: stays until its stream ends
        await until(lambda: proxy.store.current.get("b2").health is Health.HEALTHY)  # joined after a pass
        fakes[1].hang_stream = False
        held.close()
        await until(lambda: "b1" not in proxy.store.current)
        served = set()
        for _ in range(4):
            async with s.post(proxy.http_url + "/v1/chat/completions", json=CHAT) as r:
                assert r.status == 200
                served.add(r.headers["x-affinity-backend"])
        assert served == {"b0", "b2"}


async def test_sighup_and_file_change_trigger_reload(running, fakes) -> None:
    proxy, path = running
    assert proxy.resilience.reloader is not None
    path.write_text(config_text(fakes))
    os.kill(os.getpid(), signal.SIGHUP)
    await until(lambda: "b2" in proxy.store.current)
    assert proxy.resilience.reloader.last_result.reason in ("sighup", "file_changed")


async def test_file_watch_reloads_on_change(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("backends: []\n")
    applied: list[int] = []

    def apply(cfg) -> int:
        applied.append(len(cfg.backends))
        return len(applied)

    r = Reloader(str(path), apply, lambda: 0, poll_s=0.02)
    task = asyncio.create_task(r.watch())
    try:
        path.write_text("backends: [{name: a, url: 'http://127.0.0.1:1'}]\n")
        await until(lambda: applied == [1])
        path.write_text("backends: [{name: a, url: 'ftp://x'}]\n")
        await until(lambda: r.last_result is not None and not r.last_result.ok)
        assert applied == [1] and "backends[0].url" in r.last_error[0]
    finally:
        task.cancel()


async def test_admin_drain_restore_weight_answer_the_new_version(fakes) -> None:
    proxy = AffinityProxy(parse_config(config_text(fakes[:2], "health_checks: {enabled: false}\n")
                                       .replace("health_checks: {interval_ms: 30, jitter: 0.1}\n", "")))
    await proxy.start()
    try:
        admin = proxy.admin_url
        async with aiohttp.ClientSession() as s:
            async with s.post(admin + "/admin/backends/b0/drain") as r:
                body = await r.json()
            assert r.status == 200 and body == {"backend": "b0", "health": "draining",
                                                "version": proxy.store.current.version}
            for _ in range(3):
                async with s.post(proxy.http_url + "/v1/chat/completions", json=CHAT) as r:
                    assert r.headers["x-affinity-backend"] == "b1"
            async with s.post(admin + "/admin/backends/b0/restore") as r:
                assert (await r.json())["health"] == "unknown"
            async with s.post(admin + "/admin/backends/b1/weight", json={"weight": 0}) as r:
                body = await r.json()
            assert body["weight"] == 0 and body["version"] == proxy.store.current.version
            for _ in range(3):
                async with s.post(proxy.http_url + "/v1/chat/completions", json=CHAT) as r:
                    assert r.headers["x-affinity-backend"] == "b0"
            async with s.post(admin + "/admin/backends/b1/weight", json={"weight": "heavy"}) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == "weight"
            async with s.post(admin + "/admin/backends/nope/drain") as r:
                assert r.status == 404
            async with s.post(admin + "/admin/reload") as r:
                assert r.status == 409  # not started from a file
            async with s.get(admin + "/admin/health") as r:
                report = await r.json()
            assert report["version"] == proxy.store.current.version
            assert report["backends"]["b0"]["health"] == "unknown" and report["backends"]["b0"]["ejected"] is False
            assert report["retries"]["budget_requests"] >= 6
    finally:
        await proxy.stop()


async def test_admin_token_and_exposed_listener(fakes, monkeypatch) -> None:
    monkeypatch.setenv("AP_TEST_TOKEN", "s3cret")
    text = config_text(fakes[:1]).replace("admin: {port: 0}", "admin: {port: 0, token_env: AP_TEST_TOKEN}")
    proxy = AffinityProxy(parse_config(text))
    await proxy.start()
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(proxy.admin_url + "/admin/backends/b0/drain") as r:
                assert r.status == 401
            async with s.post(proxy.admin_url + "/admin/backends/b0/drain",
                              headers={"Authorization": "Bearer s3cret"}) as r:
                assert r.status == 200
    finally:
        await proxy.stop()
    # An admin listener configured beyond loopback without a token: the write endpoints refuse. (The routes
    # are served on 127.0.0.1 here: tests never bind anything else.)
    from aiohttp import web

    proxy = AffinityProxy(parse_config(config_text(fakes[:1])))
    app = web.Application()
    proxy.resilience._add_admin_routes(app, None, "10.1.2.3")
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/admin/backends/b0/drain") as r:
                assert r.status == 403 and (await r.json())["error"]["code"] == "forbidden"
            async with s.get(url + "/admin/reload") as r:
                assert r.status == 200
    finally:
        await runner.cleanup()


async def test_discovery_through_the_proxy_with_a_fake_resolver(fakes) -> None:
    port = int(fakes[0].url.rsplit(":", 1)[1])
    text = config_text([]).replace("backends:\n", "") + (
        "discovery: {enabled: true, interval_ms: 20}\n"
        f"backends:\n  - {{name: gpu, url: 'http://vllm.test.svc:{port}'}}\n")
    proxy = AffinityProxy(parse_config(text))
    answers = [["127.0.0.1"]]

    async def resolver(host: str, p: int) -> list[str]:
        assert (host, p) == ("vllm.test.svc", port)
        return answers[0]

    assert proxy.resilience.discovery is not None
    proxy.resilience.discovery.resolver = resolver
    await proxy.start()
    try:
        name = f"gpu@127.0.0.1:{port}"
        await until(lambda: name in proxy.store.current and "gpu" not in proxy.store.current)
        async with aiohttp.ClientSession() as s:
            async with s.post(proxy.http_url + "/v1/chat/completions", json=CHAT) as r:
                assert r.status == 200 and r.headers["x-affinity-backend"] == name
        answers[0] = ["127.0.0.2"]  # the pod moved: the old address drains, the new one joins
        await until(lambda: name not in proxy.store.current)
        assert f"gpu@127.0.0.2:{port}" in proxy.store.current
    finally:
        await proxy.stop()


async def test_removed_backend_leaves_no_ghost_connections(tmp_path: Path, fakes) -> None:
    # A long keep-alive, so only the drain's close of idle connections can explain them going away.
    extra = "upstream: {keepalive_s: 60}\n"
    path = tmp_path / "proxy.yaml"
    path.write_text(config_text(fakes[:2], extra).replace("health_checks: {interval_ms: 30, jitter: 0.1}\n", ""))
    proxy = AffinityProxy(load_config(str(path)), config_path=str(path))
    await proxy.start()
    try:
        port = int(fakes[1].url.rsplit(":", 1)[1])
        async with aiohttp.ClientSession() as s:
            for _ in range(6):
                async with s.post(proxy.http_url + "/v1/chat/completions", json=CHAT) as r:
                    assert r.status == 200
        assert established_to(port) >= 1  # the pool keeps an idle keep-alive connection to b1
        path.write_text(config_text(fakes[:1], extra).replace("health_checks: {interval_ms: 30, jitter: 0.1}\n", ""))
        result = await proxy.resilience.reloader.reload("test")
        assert result.ok
        await until(lambda: "b1" not in proxy.store.current, timeout=2)
        await until(lambda: established_to(port) == 0, timeout=2)
    finally:
        await proxy.stop()


# ----------------------------------------------------- one validator at every door (issue 18)


async def test_admin_reload_of_an_empty_file_keeps_the_fleet(running, fakes) -> None:
    proxy, path = running
    before = proxy.store.current.names
    async with aiohttp.ClientSession() as s:
        for text in ("", "# nothing but a comment\n", "backends: []\n", "listen: {port: 0"):
            path.write_text(text)
            async with s.post(proxy.admin_url + "/admin/reload") as r:
                body = await r.json()
            assert r.status == 422 and body["ok"] is False and body["errors"], text
            assert proxy.store.current.names == before
            async with s.post(proxy.http_url + "/v1/chat/completions", json=CHAT) as r:
                assert r.status == 200


async def test_a_file_truncated_then_rewritten_2s_later_never_empties_the_fleet(running, fakes) -> None:
    proxy, path = running
    reloader = proxy.resilience.reloader
    assert reloader is not None
    reloader.poll_s = 0.05  # the watch notices the truncated file within the gap
    good = path.read_text()
    statuses: list[int] = []
    async with aiohttp.ClientSession() as s:
        path.write_text("")  # what an editor's save or a config-map update does first
        loop = asyncio.get_running_loop()
        end = loop.time() + 2.0
        while loop.time() < end:
            assert len(proxy.store.current.routable()) == 2
            async with s.post(proxy.http_url + "/v1/chat/completions", json=CHAT) as r:
                statuses.append(r.status)
            await asyncio.sleep(0.05)
        assert reloader.last_result is not None and not reloader.last_result.ok
        assert "empty" in reloader.last_error[0]
        path.write_text(good.replace("b1", "b2").replace(fakes[1].url, fakes[2].url))
        await until(lambda: reloader.last_result is not None and reloader.last_result.ok)
    assert statuses and set(statuses) == {200}
    assert "b2" in proxy.store.current


@pytest.mark.parametrize("raw", [b'{"weight": 1e309}', b'{"weight": -1e309}', b'{"weight": NaN}',
                                 b'{"weight": Infinity}', b'{"weight": 1' + b"0" * 400 + b"}"])
async def test_http_admin_weight_refuses_what_routing_cannot_use(fakes, raw: bytes) -> None:
    proxy = AffinityProxy(parse_config(config_text(fakes[:2])))
    await proxy.start()
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(proxy.admin_url + "/admin/backends/b1/weight", data=raw,
                              headers={"content-type": "application/json"}) as r:
                body = await r.json()
            assert r.status == 400 and body["error"]["param"] == "weight", body
            assert proxy.store.current.backends[1].effective_weight == 1.0
            for _ in range(4):
                async with s.post(proxy.http_url + "/v1/chat/completions", json=CHAT) as r:
                    assert r.status == 200
    finally:
        await proxy.stop()


class _Stream:
    """Just enough of a grpclib server stream for one unary admin call."""

    def __init__(self, request: object) -> None:
        self.request = request
        self.metadata: dict[str, str] = {}
        self.sent: list[object] = []

    async def recv_message(self) -> object:
        return self.request

    async def send_message(self, message: object) -> None:
        self.sent.append(message)


@pytest.mark.parametrize("weight", [float("inf"), float("-inf"), float("nan"), -1.0])
async def test_grpc_admin_set_weight_uses_the_same_bound(weight: float) -> None:
    from grpclib.exceptions import GRPCError

    from proxy.control.store import SnapshotStore
    from proxy.core.snapshot import BackendSpec, Snapshot
    from proxy.grpc.local import AdminService
    from proxy.protos import admin_pb2

    store = SnapshotStore(Snapshot.initial([BackendSpec("a", "http://127.0.0.1:1")]))
    admin = AdminService(store, {})
    with pytest.raises(GRPCError) as info:
        await admin.SetWeight(_Stream(admin_pb2.SetWeightRequest(name="a", weight=weight)))  # type: ignore[arg-type]  # a stand-in stream
    assert info.value.status.name == "INVALID_ARGUMENT" and "weight: must be" in (info.value.message or "")
    assert store.current.backends[0].effective_weight == 1.0
    stream = _Stream(admin_pb2.SetWeightRequest(name="a", weight=2.5))
    await admin.SetWeight(stream)  # type: ignore[arg-type]  # a stand-in stream
    assert store.current.backends[0].effective_weight == 2.5
