"""`--workers 2` as real processes: the load every worker routes on is the whole proxy's, and ORCA reports
any worker sees reach the supervisor's snapshot."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from tests.deploy.procs import AFFINITY_PROXY, ProxyProcess, owner_of_connection, post_json, start_proxy
from tests.http.fakes import FakeBackend

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


async def _open_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, port: int, prompt: str) -> str:
    """Start a streaming completion on this connection; the backend that serves it."""
    body = json.dumps({"model": "fake-model", "prompt": prompt, "max_tokens": 8, "stream": True}).encode()
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


async def test_a_request_held_in_one_worker_counts_in_the_other_workers_routing(
    tmp_path: Path, hanging: list[FakeBackend]
) -> None:
    """least_request with requests alternating between the two workers: each sees the other's open streams,
    so the two backends stay balanced (on per-worker counts both workers would send their first request to
    the same backend)."""
    lines = "\n".join(f"  - {{name: {f.name}, url: '{f.url}'}}" for f in hanging)
    proxy = await _start(
        tmp_path,
        "listen: {host: 127.0.0.1, port: 0}\nadmin: {host: 127.0.0.1, port: 0}\ndebug_headers: true\n"
        f"telemetry: {{enabled: false}}\nrouting: {{policy: least_request}}\ntimeouts: {{drain_s: 2}}\n"
        f"backends:\n{lines}\n",
    )
    held: list[asyncio.StreamWriter] = []
    try:
        workers = proxy.workers()
        assert len(workers) == 2
        counts = {f.name: 0 for f in hanging}
        for i in range(6):
            reader, writer = await _connection_to(proxy, workers[i % 2])
            held.append(writer)
            counts[await _open_stream(reader, writer, proxy.port, f"prompt {i}")] += 1
            assert max(counts.values()) - min(counts.values()) <= 1, (i, counts)
        assert counts == {"gpu-0": 3, "gpu-1": 3}
        # The supervisor reads the same block: its admin view counts every worker's open streams.
        async with aiohttp.ClientSession() as session:
            async with session.get(proxy.admin + "/admin/backends") as resp:
                view = {b["name"]: b["inflight_requests"] for b in (await resp.json())["backends"]}
        assert view == {"gpu-0": 3, "gpu-1": 3}
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
            asked = [s for s in fake.seen if s.path_qs.startswith("/v1/")]
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
