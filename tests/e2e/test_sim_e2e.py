"""End to end: the real `openai` client, curl and the real CLI, through the proxy, to the real simulator."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import AsyncIterator

import aiohttp
import openai
import pytest

from sim.fleet import Fleet, start_fleet
from proxy.app import AffinityProxy
from proxy.config import parse_config
from tests.support import free_port, until

ROOT = Path(__file__).resolve().parents[2]
QUIET = "telemetry: {enabled: false}\nhealth_checks: {enabled: false}\n"




def proxy_yaml(fleet: Fleet, port: int = 0, admin_port: int = 0, policy: str = "round_robin") -> str:
    lines = "\n".join(f"  - {{name: {s.name}, url: '{s.url}'}}" for s in fleet.servers)
    return (f"listen: {{port: {port}}}\nadmin: {{port: {admin_port}}}\ndebug_headers: true\n{QUIET}"
            f"timeouts: {{drain_s: 60}}\nrouting: {{policy: {policy}}}\nbackends:\n{lines}\n")


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    f = await start_fleet(2, host="127.0.0.1", port=0, speed=4.0)
    yield f
    await f.stop()


@pytest.fixture
async def proxy(fleet: Fleet) -> AsyncIterator[AffinityProxy]:
    p = AffinityProxy(parse_config(proxy_yaml(fleet, policy="affinity")))
    await p.start()
    yield p
    await p.stop()


def model_of(fleet: Fleet) -> str:
    return fleet.servers[0].backend.engine.model_name


async def test_openai_client_through_proxy_to_simulator(fleet: Fleet, proxy: AffinityProxy) -> None:
    model = model_of(fleet)
    async with openai.AsyncOpenAI(base_url=proxy.http_url + "/v1", api_key="k", max_retries=0) as c:
        raw = await c.chat.completions.with_raw_response.create(
            model=model, max_tokens=8, messages=[{"role": "user", "content": "hello there"}])
        assert raw.headers["x-affinity-backend"] in {s.name for s in fleet.servers}
        answer = raw.parse()
        assert answer.usage is not None and answer.usage.completion_tokens == 8
        stream = await c.chat.completions.create(
            model=model, max_tokens=12, stream=True, stream_options={"include_usage": True},
            messages=[{"role": "user", "content": "tell me a story"}])
        chunks = [ch async for ch in stream]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
        assert any(ch.choices and ch.choices[0].finish_reason == "length" for ch in chunks)
        text = await c.completions.create(model=model, prompt="once upon a time", max_tokens=5)
        assert text.choices[0].text
        assert [m.id async for m in c.models.list()] == [model]


async def test_affinity_keeps_a_repeated_prompt_on_one_backend(fleet: Fleet, proxy: AffinityProxy) -> None:
    seen = set()
    async with aiohttp.ClientSession() as s:
        for _ in range(4):
            body = {"model": model_of(fleet), "max_tokens": 2, "messages": [{"role": "user", "content": "same " * 300}]}
            async with s.post(proxy.http_url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                seen.add(resp.headers["x-affinity-backend"])
    assert len(seen) == 1


async def test_client_disconnect_cancels_the_simulated_generation(fleet: Fleet, proxy: AffinityProxy) -> None:
    async with openai.AsyncOpenAI(base_url=proxy.http_url + "/v1", api_key="k", max_retries=0) as c:
        stream = await c.completions.create(model=model_of(fleet), prompt="a long one", max_tokens=5000, stream=True)
        got = 0
        async for _ in stream:
            got += 1
            if got == 3:
                break
        await stream.close()
    engines = [s.backend.engine for s in fleet.servers]
    await until(lambda: sum(e.stats.requests_aborted for e in engines) == 1 and all(e.num_running == 0 for e in engines),
                timeout=5, message="one aborted request and nothing running")
    assert proxy.inflight.total_requests == 0


async def test_simulated_backend_dying_mid_stream_gives_clean_error(fleet: Fleet) -> None:
    for s in fleet.servers:
        await s.set_faults({"drop_after_chunks": 3})
    p = AffinityProxy(parse_config(proxy_yaml(fleet)))
    await p.start()
    try:
        async with openai.AsyncOpenAI(base_url=p.http_url + "/v1", api_key="k", max_retries=0) as c:
            stream = await c.chat.completions.create(
                model=model_of(fleet), max_tokens=50, stream=True, messages=[{"role": "user", "content": "x"}])
            received = 0
            with pytest.raises(openai.APIError, match="failed while streaming"):
                async for _ in stream:
                    received += 1
            assert 1 <= received < 10  # cut short (a role chunk, then 3 token chunks), not 50 tokens
    finally:
        await p.stop()


def _start_cli(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "proxy", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)


async def _wait_ready(url: str, proc: subprocess.Popen[str]) -> None:
    async with aiohttp.ClientSession() as s:
        async def answers() -> bool:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                async with s.get(url) as resp:
                    return resp.status == 200
            except aiohttp.ClientError:
                return False

        await until(answers, timeout=30, interval=0.05, message=f"{url} answers 200")


async def test_sigterm_during_streams_loses_none(fleet: Fleet, tmp_path: Path) -> None:
    port, admin_port = free_port(), free_port()
    cfg = tmp_path / "proxy.yaml"
    cfg.write_text(proxy_yaml(fleet, port, admin_port))
    proc = _start_cli("run", "--config", str(cfg), "--workers", "1", "--log-level", "warning")
    try:
        await _wait_ready(f"http://127.0.0.1:{admin_port}/healthz", proc)
        base = f"http://127.0.0.1:{port}/v1"
        n_streams, max_tokens = 6, 300
        first_chunk = [asyncio.Event() for _ in range(n_streams)]

        async def one(i: int) -> tuple[int, str | None]:
            async with openai.AsyncOpenAI(base_url=base, api_key="k", max_retries=0) as c:
                stream = await c.completions.create(model=model_of(fleet), prompt=f"stream {i}",
                                                    max_tokens=max_tokens, stream=True, extra_body={"ignore_eos": True})
                tokens, finish = 0, None
                async for chunk in stream:
                    first_chunk[i].set()
                    tokens += 1
                    finish = chunk.choices[0].finish_reason or finish
                return tokens, finish

        tasks = [asyncio.create_task(one(i)) for i in range(n_streams)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in first_chunk)), 60)
        proc.send_signal(signal.SIGTERM)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        assert all(finish == "length" for _, finish in results), results
        assert all(tokens >= max_tokens for tokens, _ in results), results
        assert await asyncio.to_thread(proc.wait, 60) == 0
        with pytest.raises(openai.APIConnectionError):  # no longer accepting
            async with openai.AsyncOpenAI(base_url=base, api_key="k", max_retries=0) as c:
                await c.completions.create(model=model_of(fleet), prompt="late", max_tokens=1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_curl_through_the_demo() -> None:
    proc = _start_cli("demo", "--backends", "2", "--port", "0", "--admin-port", "0", "--grpc-port", "0")
    try:
        assert proc.stdout is not None
        banner: list[str] = []
        while not banner or "Ctrl-C" not in banner[-1]:
            line = await asyncio.to_thread(proc.stdout.readline)
            assert line, "demo exited early:\n" + "".join(banner)
            banner.append(line)
        text = "".join(banner)
        curl = re.search(r"^\s*(curl .*?\\\n.*?)$", text, re.M | re.S)
        assert curl is not None, text
        command = curl.group(1).split("\n\n")[0]
        run = await asyncio.to_thread(subprocess.run, ["bash", "-c", command], capture_output=True, text=True,
                                      timeout=60)
        assert run.returncode == 0, run.stderr
        assert run.stdout.startswith("HTTP/1.1 200"), run.stdout
        assert re.search(r"^x-affinity-backend: sim-[01]\r?$", run.stdout, re.M | re.I), run.stdout
        assert '"chat.completion"' in run.stdout
        proxy_url = re.search(r"^proxy\s+(http://\S+)", text, re.M).group(1)  # type: ignore[union-attr]
        models = await asyncio.to_thread(subprocess.run, ["curl", "-s", proxy_url + "/v1/models"],
                                         capture_output=True, text=True, timeout=60)
        assert '"object": "list"' in models.stdout
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = await asyncio.to_thread(proc.wait, 60)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert code == 0
