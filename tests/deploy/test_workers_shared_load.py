"""`--workers 2` as real processes: the load every worker routes on is the whole proxy's, and ORCA reports
any worker sees reach the supervisor's snapshot."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from tests.deploy.procs import AFFINITY_PROXY, ProxyProcess, owner_of_connection, post_json, start_proxy
from tests.support import FakeBackend

_VLLM_PAGE = (
    "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"fake-model\"} 0\n"
    "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name=\"fake-model\"} 0\n"
)


class _VllmFake(FakeBackend):
    """A fake that also answers telemetry scrapes like vLLM (so its signals are fresh)."""

    async def metrics(self, request: web.Request) -> web.StreamResponse:
        return web.Response(text=_VLLM_PAGE)


@pytest.fixture
async def hanging() -> AsyncIterator[list[FakeBackend]]:
    started = [FakeBackend(f"gpu-{i}") for i in range(2)]
    for f in started:
        f.hang_stream = True  # every stream stays open after its first event, until the client leaves
        await f.start()
    yield started
    for f in started:
        await f.stop()


async def _start(tmp_path: Path, text: str) -> ProxyProcess:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(text)
    return await start_proxy([AFFINITY_PROXY, "run", "--config", str(cfg), "--workers", "2"])


async def _connection_to(proxy: ProxyProcess, pid: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A client connection that the kernel handed to worker `pid` (others are closed unused)."""
    workers = proxy.workers()
    for _ in range(400):
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        local = writer.get_extra_info("sockname")[1]
        owner = None
        for _ in range(200):  # until the worker has accepted it
            owner = owner_of_connection(local, proxy.port, workers)
            if owner is not None:
                break
            await asyncio.sleep(0.005)
        if owner == pid:
            return reader, writer
        writer.close()
    raise AssertionError(f"no connection reached worker {pid}")


async def _open_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, port: int, prompt: str,
                       stream: bool = True) -> str:
    """Start a completion on this connection (a stream is left open); the backend that serves it."""
    body = json.dumps({"model": "fake-model", "prompt": prompt, "max_tokens": 8, "stream": stream}).encode()
    writer.write(
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode() + body
    )
    status = await reader.readline()
    assert b" 200 " in status, status
    backend = ""
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        if name.lower() == "x-affinity-backend":
            backend = value.strip()
    assert backend
    return backend


def _least_request_config(fakes: list[FakeBackend]) -> str:
    lines = "\n".join(f"  - {{name: {f.name}, url: '{f.url}'}}" for f in fakes)
    return (
        "listen: {host: 127.0.0.1, port: 0}\nadmin: {host: 127.0.0.1, port: 0}\ndebug_headers: true\n"
        "telemetry: {enabled: false}\nrouting: {policy: least_request}\ntimeouts: {drain_s: 2}\n"
        f"backends:\n{lines}\n"
    )


async def _admin_inflight(proxy: ProxyProcess) -> dict[str, int]:
    async with aiohttp.ClientSession() as session:
        async with session.get(proxy.admin + "/admin/backends") as resp:
            return {b["name"]: b["inflight_requests"] for b in (await resp.json())["backends"]}


async def _hold_alternating(proxy: ProxyProcess, n: int, held: list[asyncio.StreamWriter]) -> dict[str, int]:
    """`n` streams, opened one after another on workers 0, 1, 0, ... and left open; per backend, how many.
    least_request must keep the backends within one of each other after every stream: each worker counts
    the other's open streams (on per-worker counts both workers would send their first to the same one)."""
    workers = proxy.workers()
    assert len(workers) == 2
    counts: dict[str, int] = {}
    for i in range(n):
        reader, writer = await _connection_to(proxy, workers[i % 2])
        held.append(writer)
        backend = await _open_stream(reader, writer, proxy.port, f"prompt {i}")
        counts[backend] = counts.get(backend, 0) + 1
        assert max(counts.values()) - min(counts.values()) <= 1, (i, counts)
    return counts


async def test_a_request_held_in_one_worker_counts_in_the_other_workers_routing(
    tmp_path: Path, hanging: list[FakeBackend]
) -> None:
    proxy = await _start(tmp_path, _least_request_config(hanging))
    held: list[asyncio.StreamWriter] = []
    try:
        assert await _hold_alternating(proxy, 6, held) == {"gpu-0": 3, "gpu-1": 3}
        # The supervisor reads the same block: its admin view counts every worker's open streams.
        assert await _admin_inflight(proxy) == {"gpu-0": 3, "gpu-1": 3}
    finally:
        for writer in held:
            writer.close()
        assert await proxy.terminate() == 0


async def test_a_backend_added_by_reload_is_shared_across_workers(
    tmp_path: Path, hanging: list[FakeBackend]
) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(_least_request_config(hanging[:1]))
    proxy = await start_proxy([AFFINITY_PROXY, "run", "--config", str(cfg), "--workers", "2"])
    held: list[asyncio.StreamWriter] = []
    try:
        cfg.write_text(_least_request_config(hanging))
        os.kill(proxy.pid, signal.SIGHUP)
        for _ in range(600):  # a guard against hanging, not a timing assertion
            if "gpu-1" in await _admin_inflight(proxy):
                break
            await asyncio.sleep(0.05)
        for pid in proxy.workers():  # until each worker has the new snapshot (and its slot map)
            for i in range(100):
                reader, writer = await _connection_to(proxy, pid)
                backend = await _open_stream(reader, writer, proxy.port, f"probe {i}", stream=False)
                writer.close()
                if backend == "gpu-1":
                    break
            assert backend == "gpu-1"
        for _ in range(600):  # the probes are done everywhere
            if await _admin_inflight(proxy) == {"gpu-0": 0, "gpu-1": 0}:
                break
            await asyncio.sleep(0.02)
        assert await _hold_alternating(proxy, 4, held) == {"gpu-0": 2, "gpu-1": 2}
        assert await _admin_inflight(proxy) == {"gpu-0": 2, "gpu-1": 2}
    finally:
        for writer in held:
            writer.close()
        assert await proxy.terminate() == 0


async def test_a_killed_workers_requests_leave_the_shared_load(tmp_path: Path, hanging: list[FakeBackend]) -> None:
    proxy = await _start(tmp_path, _least_request_config(hanging))
    held: list[asyncio.StreamWriter] = []
    try:
        assert await _hold_alternating(proxy, 4, held) == {"gpu-0": 2, "gpu-1": 2}
        victim, survivor = proxy.workers()
        os.kill(victim, signal.SIGKILL)
        for _ in range(600):  # a guard against hanging, not a timing assertion
            if sum((await _admin_inflight(proxy)).values()) == 2:
                break
            await asyncio.sleep(0.02)
        # The survivor's two streams are still open and counted; the dead worker's row is cleared.
        assert sum((await _admin_inflight(proxy)).values()) == 2
        assert survivor in proxy.workers()
    finally:
        for writer in held:
            writer.close()
        assert await proxy.terminate() == 0


async def test_orca_reports_seen_by_workers_reach_the_supervisors_snapshot(tmp_path: Path) -> None:
    fake = _VllmFake("gpu-0")
    fake.response_headers = {"endpoint-load-metrics": "TEXT named_metrics.num_requests_waiting=77"}
    await fake.start()
    proxy = await _start(
        tmp_path,
        "listen: {host: 127.0.0.1, port: 0}\nadmin: {host: 127.0.0.1, port: 0}\n"
        "telemetry: {interval_ms: 60000, orca: true}\n"
        f"backends:\n  - {{name: gpu-0, url: '{fake.url}'}}\n",
    )
    try:
        async with aiohttp.ClientSession() as session:

            async def waiting() -> float | None:
                async with session.get(proxy.admin + "/admin/backends") as resp:
                    signals = (await resp.json())["backends"][0]["signals"]
                return None if signals is None else signals["waiting"]

            for _ in range(400):  # the first scrape: fresh signals, nothing waiting
                if await waiting() == 0:
                    break
                await asyncio.sleep(0.025)
            assert await waiting() == 0
            served_by: set[int | None] = set()
            sent = 0
            pids = proxy.workers()
            while served_by != set(pids) and sent < 60:  # fresh connections, until both workers served some
                reply = await post_json(
                    proxy.port, "/v1/completions", {"model": "fake-model", "prompt": f"hi {sent}", "max_tokens": 2},
                    lambda r: served_by.add(owner_of_connection(r.local_port, proxy.port, pids)),
                )
                sent += 1
                assert reply.status == 200, reply.body
                assert "endpoint-load-metrics" not in reply.headers  # asked for by the proxy: consumed
            assert served_by == set(pids)
            # (GET /v1/models is the supervisor's adapter discovery, not a proxied request)
            asked = [s for s in fake.seen if s.path_qs.startswith("/v1/") and s.path_qs != "/v1/models"]
            assert asked and all(s.headers.get("endpoint-load-metrics-format") == "TEXT" for s in asked)
            for _ in range(400):
                if await waiting() == 77:
                    break
                await asyncio.sleep(0.025)
            assert await waiting() == 77
            async with session.get(proxy.admin + "/metrics") as resp:
                text = await resp.text()
            reports = [ln for ln in text.splitlines() if ln.startswith("affinity_proxy_telemetry_orca_reports_total")]
            assert reports and float(reports[0].split()[-1]) == sent  # every worker's reports
    finally:
        assert await proxy.terminate() == 0
        await fake.stop()
