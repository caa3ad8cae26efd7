"""`affinity-proxy run --workers 2` as a real process tree: one supervisor, two SO_REUSEPORT workers.

The backends are the HTTP tests' scriptable fakes, running in the test's own event loop; the proxy runs in
subprocesses exactly as a user starts it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections import defaultdict
from pathlib import Path
from typing import AsyncIterator

import aiohttp
import pytest

from tests.deploy.procs import AFFINITY_PROXY, ProxyProcess, owner_of_connection, post_json, start_proxy
from tests.support import FakeBackend, until


def _config(fakes: list[FakeBackend], policy: str) -> str:
    lines = "\n".join(f"  - {{name: {f.name}, url: '{f.url}'}}" for f in fakes)
    return (
        "listen: {host: 127.0.0.1, port: 0}\nadmin: {host: 127.0.0.1, port: 0}\ndebug_headers: true\n"
        f"routing: {{policy: {policy}}}\ntimeouts: {{drain_s: 20}}\nbackends:\n{lines}\n"
    )


@pytest.fixture
async def fakes() -> AsyncIterator[list[FakeBackend]]:
    started = [FakeBackend(f"gpu-{i}") for i in range(4)]
    for f in started:
        await f.start()
    yield started
    for f in started:
        await f.stop()


async def _run(tmp_path: Path, fakes: list[FakeBackend], policy: str) -> ProxyProcess:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(_config(fakes, policy))
    return await start_proxy([AFFINITY_PROXY, "run", "--config", str(cfg), "--workers", "2"])


def _completions(fake: FakeBackend) -> int:
    """Requests proxied to `fake` (its health checks, metric scrapes and /v1/models adapter discovery come
    from the supervisor)."""
    return sum(1 for s in fake.seen if s.path_qs.startswith("/v1/") and s.path_qs != "/v1/models")


def _body(prompt: str, stream: bool = False) -> dict[str, object]:
    return {"model": "fake-model", "prompt": prompt, "max_tokens": 8, "stream": stream}


async def test_same_prompt_same_backend_in_every_worker(tmp_path: Path, fakes: list[FakeBackend]) -> None:
    proxy = await _run(tmp_path, fakes, "affinity")
    try:
        workers = proxy.workers()
        assert len(workers) == 2
        backends: dict[str, set[str]] = defaultdict(set)
        served_by: dict[str, set[int]] = defaultdict(set)
        prompts = [f"request {i}: " + " ".join(f"word{i * 7 + j}" for j in range(40)) for i in range(20)]
        # A fresh connection per request, so the kernel spreads each prompt's requests over both workers.
        for round_ in range(6):
            for prompt in prompts:
                owner: list[int | None] = []
                reply = await post_json(
                    proxy.port, "/v1/completions", _body(prompt),
                    lambda r: owner.append(owner_of_connection(r.local_port, proxy.port, workers)),
                )
                assert reply.status == 200, reply.body
                assert owner[0] in workers
                served_by[prompt].add(owner[0])
                backends[prompt].add(reply.headers["x-affinity-backend"])
        assert all(len(b) == 1 for b in backends.values()), dict(backends)
        # Not trivially one backend for everything, and the same prompts really went through both workers.
        assert len({next(iter(b)) for b in backends.values()}) >= 2
        assert set().union(*served_by.values()) == set(workers)
        assert sum(1 for pids in served_by.values() if len(pids) == 2) >= 10
    finally:
        assert await proxy.terminate() == 0


async def _open_stream(session: aiohttp.ClientSession, url: str, prompt: str) -> aiohttp.ClientResponse:
    resp = await session.post(f"{url}/v1/completions", json=_body(prompt, stream=True))
    assert resp.status == 200
    first = await resp.content.readline()
    assert first.startswith(b"data: ")
    return resp


async def _finish(resp: aiohttp.ClientResponse) -> bool:
    """True when the stream ended with the backend's [DONE]; False when the connection broke."""
    try:
        text = (await resp.content.read()).decode()
    except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError):
        return False
    finally:
        resp.release()
    return text.rstrip().endswith("data: [DONE]")


async def test_killed_worker_loses_nothing_on_the_other_and_comes_back(
    tmp_path: Path, fakes: list[FakeBackend]
) -> None:
    for f in fakes:
        f.events, f.event_delay = 60, 0.05  # 3 s streams: still running when counted and when the worker dies
    proxy = await _run(tmp_path, fakes, "round_robin")
    try:
        workers = proxy.workers()
        victim, survivor = workers
        on: dict[int, list[aiohttp.ClientResponse]] = {victim: [], survivor: []}
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
            # Open streams on fresh connections until each worker carries at least three of them.
            for i in range(64):
                resp = await _open_stream(session, proxy.http, f"stream {i}")
                local_port = resp.connection.transport.get_extra_info("sockname")[1]
                on[owner_of_connection(local_port, proxy.port, workers)].append(resp)
                if min(len(v) for v in on.values()) >= 3:
                    break
            assert min(len(v) for v in on.values()) >= 3
            # The supervisor's admin API sees the workers' in-flight streams (it has none of its own).
            opened = sum(len(v) for v in on.values())
            async def counted() -> bool:
                return sum(b["inflight_requests"] for b in (await _backends(session, proxy)).values()) == opened

            await until(counted, timeout=30, interval=0.02, message=f"the supervisor counts {opened} streams")
            os.kill(victim, signal.SIGKILL)
            survived = await asyncio.gather(*(_finish(r) for r in on[survivor]))
            lost = await asyncio.gather(*(_finish(r) for r in on[victim]))
            assert all(survived), survived  # every stream on the other worker completed
            assert not any(lost)  # the victim's own streams really were cut (the kill was real)

            # It comes back: the supervisor restarts the slot, and the new process serves again.
            async def replacement_ready() -> int | None:
                now = proxy.workers()
                new = [p for p in now if p not in workers]
                if new and len(now) == 2:
                    async with session.get(f"{proxy.admin}/metrics") as resp:
                        if 'affinity_proxy_workers{state="ready"} 2.0' in await resp.text():
                            return new[0]
                return None

            replacement = await until(replacement_ready, timeout=60, interval=0.1, message="a new worker is ready")
            hits = 0
            for i in range(200):
                owners: list[int | None] = []
                reply = await post_json(
                    proxy.port, "/v1/completions", _body(f"after {i}"),
                    lambda r: owners.append(owner_of_connection(r.local_port, proxy.port, [replacement, survivor])),
                )
                assert reply.status == 200
                hits += owners[0] == replacement
                if hits >= 3:
                    break
            assert hits >= 3
            async with session.get(f"{proxy.admin}/metrics") as resp:
                text = await resp.text()
            assert "affinity_proxy_worker_restarts_total 1.0" in text
            assert 'affinity_proxy_workers{state="ready"} 2.0' in text
    finally:
        assert await proxy.terminate() == 0


async def test_sigterm_drains_open_streams_in_every_worker(tmp_path: Path, fakes: list[FakeBackend]) -> None:
    for f in fakes:
        f.events, f.event_delay = 20, 0.05
    proxy = await _run(tmp_path, fakes, "round_robin")
    workers = proxy.workers()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        streams = []
        owners = set()
        for i in range(32):
            resp = await _open_stream(session, proxy.http, f"drain {i}")
            owners.add(owner_of_connection(resp.connection.transport.get_extra_info("sockname")[1], proxy.port, workers))
            streams.append(resp)
            if owners == set(workers):
                break
        assert owners == set(workers)
        proxy.proc.send_signal(signal.SIGTERM)
        completed = await asyncio.gather(*(_finish(r) for r in streams))
    assert all(completed), completed
    assert await proxy.terminate() == 0
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()]


async def test_metrics_merge_requests_from_both_workers(tmp_path: Path, fakes: list[FakeBackend]) -> None:
    proxy = await _run(tmp_path, fakes, "round_robin")
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
            for i in range(40):
                async with session.post(f"{proxy.http}/v1/completions", json=_body(f"m {i}")) as resp:
                    assert resp.status == 200
                    await resp.read()
            async with session.get(f"{proxy.admin}/metrics") as resp:
                text = await resp.text()
            async with session.get(f"{proxy.admin}/admin/backends") as resp:
                snapshot = json.loads(await resp.text())
        total = 0.0
        for line in text.splitlines():
            if line.startswith("affinity_proxy_requests_total{"):
                total += float(line.rsplit(" ", 1)[1])
        assert total == 40
        assert {b["name"] for b in snapshot["backends"]} == {f.name for f in fakes}
    finally:
        assert await proxy.terminate() == 0


async def _backends(session: aiohttp.ClientSession, proxy: ProxyProcess) -> dict[str, dict[str, object]]:
    async with session.get(f"{proxy.admin}/admin/backends") as resp:
        return {b["name"]: b for b in json.loads(await resp.text())["backends"]}


async def test_failures_seen_by_both_workers_eject_once_for_the_whole_proxy(
    tmp_path: Path, fakes: list[FakeBackend]
) -> None:
    fakes[3].status = 500
    cfg = tmp_path / "config.yaml"
    # No active checks: only the workers' passive reports, forwarded to the supervisor, can eject gpu-3.
    cfg.write_text(
        _config(fakes, "round_robin")
        + "health_checks: {enabled: false}\noutlier_detection: {consecutive_5xx: 6, base_ejection_ms: 60000}\n"
    )
    proxy = await start_proxy([AFFINITY_PROXY, "run", "--config", str(cfg), "--workers", "2"])
    try:
        workers = proxy.workers()
        failed_on: set[int] = set()
        async with aiohttp.ClientSession() as session:
            for i in range(200):
                owner: list[int | None] = []
                reply = await post_json(
                    proxy.port, "/v1/completions", _body(f"e {i}"),
                    lambda r: owner.append(owner_of_connection(r.local_port, proxy.port, workers)),
                )
                if reply.status == 500:
                    failed_on.add(owner[0])
                if (await _backends(session, proxy))["gpu-3"]["health"] == "unhealthy":
                    break
            assert (await _backends(session, proxy))["gpu-3"]["health"] == "unhealthy"
            # The six failures came through both workers: neither alone saw enough to eject.
            assert failed_on == set(workers)
            seen = _completions(fakes[3])
            for i in range(20):
                reply = await post_json(proxy.port, "/v1/completions", _body(f"after {i}"))
                assert reply.status == 200
            assert _completions(fakes[3]) == seen  # every worker routes on the supervisor's ejection
            async with session.get(f"{proxy.admin}/metrics") as resp:
                assert 'affinity_proxy_outlier_ejections_total{backend="gpu-3"} 1.0' in await resp.text()
    finally:
        assert await proxy.terminate() == 0


async def test_reload_reaches_every_worker(tmp_path: Path, fakes: list[FakeBackend]) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(_config(fakes, "round_robin"))
    proxy = await start_proxy([AFFINITY_PROXY, "run", "--config", str(cfg), "--workers", "2"])
    try:
        cfg.write_text(_config(fakes[:3], "least_request"))
        os.kill(proxy.pid, signal.SIGHUP)
        async with aiohttp.ClientSession() as session:
            async def gpu3_gone() -> bool:
                return "gpu-3" not in await _backends(session, proxy)

            await until(gpu3_gone, timeout=30, interval=0.05, message="the reload removed gpu-3")
            seen = _completions(fakes[3])
            workers = proxy.workers()
            owners: set[int | None] = set()
            for i in range(40):
                reply = await post_json(
                    proxy.port, "/v1/completions", _body(f"r {i}"),
                    lambda r: owners.add(owner_of_connection(r.local_port, proxy.port, workers)),
                )
                assert reply.status == 200
            assert owners == set(workers)
            assert _completions(fakes[3]) == seen  # the removed backend gets nothing from any worker
            async with session.get(f"{proxy.admin}/metrics") as resp:
                text = await resp.text()
        # The routing policy is data-plane state: only the forwarded reload can change it in the workers.
        decided = sum(
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith('affinity_proxy_routing_decisions_total{policy="least_request"')
        )
        assert decided == 40
    finally:
        assert await proxy.terminate() == 0


async def test_grpc_admin_write_in_one_worker_reaches_every_worker(tmp_path: Path, fakes: list[FakeBackend]) -> None:
    import grpc

    from proxy.protos import admin_pb2
    from tests.grpc import stubs

    cfg = tmp_path / "config.yaml"
    cfg.write_text(_config(fakes, "round_robin") + "grpc_listen: {host: 127.0.0.1, port: 0}\n")
    proxy = await start_proxy([AFFINITY_PROXY, "run", "--config", str(cfg), "--workers", "2"])
    try:
        assert proxy.grpc
        async with grpc.aio.insecure_channel(proxy.grpc) as ch:
            status = await stubs.admin(ch, "SetWeight")(admin_pb2.SetWeightRequest(name="gpu-1", weight=0))
            assert status.weight == 0
        async with aiohttp.ClientSession() as session:
            async def weight_zero() -> bool:
                return (await _backends(session, proxy))["gpu-1"]["weight"] == 0

            await until(weight_zero, timeout=30, interval=0.05, message="the supervisor has gpu-1's weight 0")
        workers = proxy.workers()
        owners: set[int | None] = set()
        seen = _completions(fakes[1])
        for i in range(40):
            reply = await post_json(
                proxy.port, "/v1/completions", _body(f"g {i}"),
                lambda r: owners.add(owner_of_connection(r.local_port, proxy.port, workers)),
            )
            assert reply.status == 200
        assert owners == set(workers)
        assert _completions(fakes[1]) == seen  # weight 0 in every worker, not only the one that took the call
    finally:
        assert await proxy.terminate() == 0


async def test_two_replicas_place_every_prompt_on_the_same_backend(tmp_path: Path, fakes: list[FakeBackend]) -> None:
    """Two independent proxies (as two Kubernetes replicas: no shared state at all) with the same config."""
    cfg = tmp_path / "config.yaml"
    cfg.write_text(_config(fakes, "affinity"))
    replicas = [await start_proxy([AFFINITY_PROXY, "run", "--config", str(cfg), "--workers", w]) for w in ("1", "2")]
    try:
        placed: list[dict[str, str]] = [{}, {}]
        chats = [
            {"model": "fake-model", "max_tokens": 8,
             "messages": [{"role": "system", "content": "You are a helpful assistant. " * 20},
                          {"role": "user", "content": f"question {i}: " + " ".join(f"w{i}x{j}" for j in range(30))}]}
            for i in range(24)
        ]
        for which, proxy in enumerate(replicas):
            for i, chat in enumerate(chats):
                reply = await post_json(proxy.port, "/v1/chat/completions", chat)
                assert reply.status == 200
                placed[which][f"chat {i}"] = reply.headers["x-affinity-backend"]
        assert placed[0] == placed[1]
        # Conversations that share only the system prompt still spread over the fleet.
        assert len(set(placed[0].values())) >= 3
    finally:
        for proxy in replicas:
            assert await proxy.terminate() == 0


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # an exited orphan waiting for init to reap it is gone for our purpose


async def test_workers_leave_when_their_supervisor_is_killed(tmp_path: Path, fakes: list[FakeBackend]) -> None:
    proxy = await _run(tmp_path, fakes, "round_robin")
    workers = proxy.workers()
    os.kill(proxy.pid, signal.SIGKILL)
    await proxy.proc.wait()
    try:
        await until(lambda: not any(_running(pid) for pid in workers), timeout=30, interval=0.05,
                    message="workers leave without their supervisor")
    finally:
        for pid in [pid for pid in workers if _running(pid)]:  # no orphans left behind, even on failure
            os.kill(pid, signal.SIGKILL)


async def test_only_the_supervisor_scrapes_and_checks_the_backends(tmp_path: Path) -> None:
    """No N-fold scraping: every /metrics and /health request reaching a backend comes from the supervisor."""
    from aiohttp import web

    from tests.deploy.procs import owner_of_connection as owner

    callers: list[tuple[str, int | None]] = []
    pids: list[int] = []
    page = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"m\"} 1\n"

    async def control(request: web.Request) -> web.Response:
        peer_port = request.transport.get_extra_info("peername")[1]  # type: ignore[union-attr]
        my_port = request.transport.get_extra_info("sockname")[1]  # type: ignore[union-attr]
        # The proxy's end of this connection: local port = peer_port, remote = my_port. (Requests that come
        # before the test knows the proxy's pids are not judged.)
        if pids:
            callers.append((request.path, owner(my_port, peer_port, pids)))
        return web.Response(text=page if request.path == "/metrics" else "ok")

    app = web.Application()
    app.router.add_get("/metrics", control)
    app.router.add_get("/health", control)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        "listen: {host: 127.0.0.1, port: 0}\nadmin: {host: 127.0.0.1, port: 0}\n"
        "telemetry: {interval_ms: 50, timeout_ms: 40}\nhealth_checks: {interval_ms: 100}\n"
        f"backends:\n  - {{name: gpu-0, url: '{url}'}}\n"
    )
    proxy = await start_proxy([AFFINITY_PROXY, "run", "--config", str(cfg), "--workers", "2"])
    try:
        pids.extend([proxy.pid, *proxy.workers()])
        def polled() -> bool:
            paths = [p for p, _ in callers]
            return paths.count("/metrics") >= 10 and paths.count("/health") >= 3

        await until(polled, timeout=30, interval=0.05, message="10 scrapes and 3 health checks")
        assert {p for p, _ in callers} == {"/metrics", "/health"}
        # None: the caller's socket was already gone when looked up (a 40 ms scrape timeout under a loaded
        # machine closes it first); that says nothing of who made it. No call may come from a worker, and
        # the supervisor must be seen making them (on this loaded 2-core machine most lookups come too late).
        owners = [who for _, who in callers]
        assert not set(owners) & set(pids[1:]), callers
        assert proxy.pid in owners, callers
    finally:
        assert await proxy.terminate() == 0
        await runner.cleanup()


async def test_removed_backend_drains_until_the_workers_streams_finish(tmp_path: Path, fakes: list[FakeBackend]) -> None:
    for f in fakes:
        f.events, f.event_delay = 40, 0.05  # 2 s streams
    cfg = tmp_path / "config.yaml"
    cfg.write_text(_config(fakes, "round_robin"))
    proxy = await start_proxy([AFFINITY_PROXY, "run", "--config", str(cfg), "--workers", "2"])
    try:
        async with aiohttp.ClientSession() as session:
            stream = await _open_stream(session, proxy.http, "long")
            victim = stream.headers["x-affinity-backend"]
            async def state_is(key: str, value: object) -> bool:
                return (await _backends(session, proxy))[victim][key] == value

            await until(lambda: state_is("inflight_requests", 1), timeout=30, interval=0.02,
                        message="the supervisor counts the stream")
            cfg.write_text(_config([f for f in fakes if f.name != victim], "round_robin"))
            os.kill(proxy.pid, signal.SIGHUP)
            await until(lambda: state_is("health", "draining"), timeout=30, interval=0.02,
                        message=f"{victim} is draining")
            # Draining, not gone, while a worker still streams from it: the supervisor knows.
            state = await _backends(session, proxy)
            assert state[victim]["health"] == "draining" and state[victim]["inflight_requests"] == 1
            assert await _finish(stream)
            async def gone() -> bool:
                return victim not in await _backends(session, proxy)

            await until(gone, timeout=30, interval=0.05, message=f"{victim} has left")
            async with session.get(f"{proxy.admin}/metrics") as resp:
                assert 'affinity_proxy_backends_drained_total{how="idle"} 1.0' in await resp.text()
    finally:
        assert await proxy.terminate() == 0


async def test_a_second_proxy_on_the_same_port_refuses_to_start(tmp_path: Path, fakes: list[FakeBackend]) -> None:
    """SO_REUSEPORT would let it join the first one's listening group and take half its connections."""
    first = await _run(tmp_path, fakes, "round_robin")
    try:
        cfg = tmp_path / "second.yaml"
        cfg.write_text(_config(fakes, "round_robin").replace("port: 0}\nadmin", f"port: {first.port}}}\nadmin"))
        second = await asyncio.create_subprocess_exec(
            AFFINITY_PROXY, "run", "--config", str(cfg), "--workers", "2", stderr=asyncio.subprocess.PIPE
        )
        _, err = await asyncio.wait_for(second.communicate(), 60)
        assert second.returncode == 1
        assert f"cannot listen on 127.0.0.1:{first.port}" in err.decode()
        assert "Traceback" not in err.decode()
    finally:
        assert await first.terminate() == 0
