"""The drain deadline through the real CLI: at timeouts.drain_s the streams still open end with an error
the clients can read (an OpenAI error event; gRPC UNAVAILABLE), and the process exits promptly."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import AsyncIterator

import grpc
import openai
import pytest

from proxy.protos import generate_pb2 as gen
from sim.fleet import Fleet, start_fleet
from tests.deploy.procs import AFFINITY_PROXY, start_proxy
from tests.grpc import stubs
from tests.support import free_port

DRAIN_S = 2.0


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    f = await start_fleet(1, grpc_port=0, speed=1.0)  # real time: a long generation outlives the drain
    yield f
    await f.stop()


async def test_streams_longer_than_the_drain_end_with_an_error_event_and_the_process_exits(
        fleet: Fleet, tmp_path: Path) -> None:
    s = fleet.servers[0]
    grpc_port = free_port()
    cfg = tmp_path / "proxy.yaml"
    cfg.write_text(
        f"listen: {{port: 0}}\nadmin: {{port: 0}}\ngrpc_listen: {{port: {grpc_port}}}\n"
        f"telemetry: {{enabled: false}}\nhealth_checks: {{enabled: false}}\ntimeouts: {{drain_s: {DRAIN_S}}}\n"
        f"backends:\n  - {{name: {s.name}, url: '{s.url}', grpc: '{s.grpc_address}'}}\n")
    proc = await start_proxy([AFFINITY_PROXY, "run", "-c", str(cfg), "--workers", "1"])
    model = s.backend.engine.model_name
    try:
        client = openai.AsyncOpenAI(base_url=proc.http + "/v1", api_key="x", max_retries=0)
        stream = await client.chat.completions.create(
            model=model, stream=True, max_tokens=4000, extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": "tell me a very long story"}])
        it = stream.__aiter__()
        await it.__anext__()  # the stream is flowing
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}")
        call = stubs.generate_stream(channel)(gen.GenerateRequest(prompt="long", max_tokens=4000, ignore_eos=True))
        assert await call.read() is not grpc.aio.EOF

        async def read_http() -> BaseException | None:
            try:
                async for _ in it:
                    pass
            except BaseException as exc:  # what the openai client raised
                return exc
            return None

        async def read_grpc() -> grpc.StatusCode:
            try:
                while await call.read() is not grpc.aio.EOF:
                    pass
            except grpc.aio.AioRpcError as exc:
                assert "shutting down" in (exc.details() or "")
            return await call.code()

        readers = asyncio.gather(read_http(), read_grpc())
        await asyncio.sleep(0.2)
        sent = time.monotonic()
        proc.proc.send_signal(signal.SIGTERM)
        err, code = await asyncio.wait_for(readers, DRAIN_S + 10)
        code_rc = await asyncio.wait_for(proc.proc.wait(), DRAIN_S + 10)
        exited = time.monotonic() - sent
        await channel.close()
        await client.close()
    finally:
        rc = await proc.terminate()
    assert isinstance(err, openai.APIError) and not isinstance(err, openai.APIConnectionError), repr(err)
    assert "shutting down" in str(err)
    assert code == grpc.StatusCode.UNAVAILABLE
    assert code_rc == 0 and rc == 0
    assert DRAIN_S - 0.3 <= exited <= DRAIN_S + 1.0, exited
