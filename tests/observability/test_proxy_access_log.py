"""The access log of the real proxy, against the simulator: one JSON line per request for HTTP/1.1, the
HTTP/2 bridge and gRPC, with the fields an operator asks for (and a rejected request logged too)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import AsyncIterator

import grpc
import httpx
import pytest

from proxy.app import AffinityProxy
from proxy.config import parse_config
from proxy.protos import generate_pb2 as gen
from sim.fleet import Fleet, start_fleet
from tests.support import until

FIELDS = {"time", "started", "request_id", "trace_id", "client", "protocol", "method", "path", "model", "adapter",
          "session", "policy", "reason", "backend", "attempts", "status", "grpc_status", "error", "ttft_s",
          "duration_s", "prompt_tokens", "cached_tokens", "bytes_in", "bytes_out", "load_score", "inflight",
          "kv_holder", "kv_cached"}


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    f = await start_fleet(2, grpc_port=0, speed=200.0)
    yield f
    await f.stop()


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def test_every_protocol_writes_one_json_line_per_request(fleet: Fleet, tmp_path: Path) -> None:
    log_path = tmp_path / "access.log"
    model = fleet.servers[0].backend.engine.model_name
    # The models are configured, so that the proxy itself rejects an unknown one (backend null in its line).
    backends = "\n".join(f"  - {{name: {s.name}, url: '{s.url}', grpc: '{s.grpc_address}', models: ['{model}']}}"
                         for s in fleet.servers)
    config = parse_config(
        "listen: {port: 0}\ngrpc_listen: {port: 0}\nadmin: {port: 0}\n"
        "telemetry: {enabled: false}\nhealth_checks: {enabled: false}\n"
        f"logging: {{format: json, access_log: {{path: '{log_path}', flush_interval_s: 0}}}}\n"
        "tracing: {enabled: true, sampler: always_off}\n"
        "routing: {policy: round_robin, session_header: x-session-id}\n"
        f"backends:\n{backends}\n", "<test>")
    proxy = AffinityProxy(config)
    await proxy.start()
    body = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "log this request"}]}
    try:
        async with httpx.AsyncClient() as c:
            r = await c.post(proxy.http_url + "/v1/chat/completions", json=body,
                             headers={"x-request-id": "req-http1", "x-session-id": "sess-1"})
            assert r.status_code == 200 and r.http_version == "HTTP/1.1"
            sent = len(r.request.content)
            r = await c.post(proxy.http_url + "/v1/chat/completions", json={**body, "model": "no-such-model"},
                             headers={"x-request-id": "req-rejected"})
            assert r.status_code == 404
        assert proxy.grpc is not None
        grpc_url = f"http://127.0.0.1:{proxy.grpc.port}"
        async with httpx.AsyncClient(http1=False, http2=True) as c:
            r = await c.post(grpc_url + "/v1/chat/completions", json={**body, "stream": True},
                             headers={"x-request-id": "req-h2"})
            assert r.status_code == 200 and r.http_version == "HTTP/2"
        async with grpc.aio.insecure_channel(f"127.0.0.1:{proxy.grpc.port}") as ch:
            call = ch.unary_unary("/affinity.v1.Generation/Generate",
                                  request_serializer=gen.GenerateRequest.SerializeToString,
                                  response_deserializer=gen.GenerateResponse.FromString)
            reply = await call(gen.GenerateRequest(model=model, prompt="log this call", max_tokens=3),
                               metadata=(("x-request-id", "req-grpc"),), timeout=10)
            assert reply.text
        by_id = await until(lambda: (lambda got: got if len(got) >= 4 else None)(
            {line["request_id"]: line for line in lines(log_path)}), timeout=10)
    finally:
        await proxy.stop()
    for line in by_id.values():
        assert set(line) == FIELDS  # one stable schema, null when unknown
        assert line["time"] > 1.6e9 and line["duration_s"] >= 0 and len(line["trace_id"]) == 32
        assert line["client"].startswith("127.0.0.1")  # the peer address (gRPC and h2: with its port)
    names = {s.name for s in fleet.servers}
    h1, h2, g, rejected = by_id["req-http1"], by_id["req-h2"], by_id["req-grpc"], by_id["req-rejected"]
    assert (h1["protocol"], h1["method"], h1["path"], h1["model"]) == ("http/1.1", "POST", "/v1/chat/completions", model)
    assert h1["status"] == 200 and h1["backend"] in names and h1["policy"] == "round_robin" and h1["reason"]
    assert h1["attempts"] == 1 and h1["session"] == "sess-1" and h1["error"] is None
    assert h1["prompt_tokens"] > 0 and h1["bytes_in"] == sent and h1["bytes_out"] > 0
    assert 0 < h1["ttft_s"] <= h1["duration_s"] and h1["inflight"] >= 1
    assert (h2["protocol"], h2["status"], h2["path"]) == ("h2", 200, "/v1/chat/completions") and h2["backend"] in names
    assert h2["ttft_s"] is not None
    assert (g["protocol"], g["path"], g["status"], g["grpc_status"]) == ("grpc", "/affinity.v1.Generation/Generate", 200, 0)
    assert g["backend"] in names and g["model"] == model and g["attempts"] == 1 and g["ttft_s"] is not None
    assert g["bytes_in"] > 0 and g["bytes_out"] > 0
    assert rejected["status"] == 404 and rejected["backend"] is None and rejected["error"] == "model_not_found"
    assert rejected["attempts"] == 0


async def test_access_log_off_and_text_format(fleet: Fleet, tmp_path: Path) -> None:
    log_path = tmp_path / "access.log"
    backends = "\n".join(f"  - {{name: {s.name}, url: '{s.url}'}}" for s in fleet.servers)
    base = ("listen: {port: 0}\nadmin: {port: 0}\ntelemetry: {enabled: false}\nhealth_checks: {enabled: false}\n"
            f"backends:\n{backends}\n")
    for logging_section, expect in (
        (f"logging: {{format: text, access_log: {{path: '{log_path}', flush_interval_s: 0}}}}\n", "text"),
        (f"logging: {{access_log: {{enabled: false, path: '{log_path}.off'}}}}\n", "off"),
    ):
        proxy = AffinityProxy(parse_config(base + logging_section, "<test>"))
        await proxy.start()
        try:
            async with httpx.AsyncClient() as c:
                r = await c.get(proxy.http_url + "/health", headers={"x-request-id": "req-text"})
                assert r.status_code == 200
        finally:
            await proxy.stop()
        if expect == "text":
            (line,) = log_path.read_text().splitlines()
            assert line.startswith("time=") and " request_id=req-text " in line and " status=200 " in line
        else:
            assert not Path(f"{log_path}.off").exists()


async def test_a_stdout_nobody_reads_does_not_stop_the_proxy(fleet: Fleet, tmp_path: Path) -> None:
    # Issue 18's soak hang, through the real CLI: the access log goes to standard output (the default), and
    # stdout is a pipe whose reader never reads (a stalled log shipper; the soak's parent read one line).
    # Once the pipe was full, the access log's blocking write froze the whole process. Now the proxy keeps
    # serving, drops the lines the pipe cannot take and counts them.
    import fcntl
    import os
    import re
    import sys
    import time

    s = fleet.servers[0]
    cfg = tmp_path / "proxy.yaml"
    cfg.write_text("listen: {port: 0}\nadmin: {port: 0}\ntelemetry: {enabled: false}\n"
                   "health_checks: {enabled: false}\n"
                   f"backends:\n  - {{name: {s.name}, url: '{s.url}'}}\n")
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 4096)  # one page: full after a few lines (64 KiB by default)
    proc = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).with_name("affinity-proxy")), "run", "-c", str(cfg), "--workers", "1",
        stdout=write_end, stderr=asyncio.subprocess.PIPE)
    os.close(write_end)
    log: list[str] = []
    try:
        assert proc.stderr is not None

        async def listening() -> tuple[str, str]:
            assert proc.stderr is not None
            async for raw in proc.stderr:
                log.append(raw.decode(errors="replace"))
                if m := re.search(r"listening on (http://\S+) \(admin (http://[^\s)\\\"]+)\)", log[-1]):
                    return m[1], m[2]
            raise AssertionError("the proxy exited before serving:\n" + "".join(log[-30:]))

        http, admin = await asyncio.wait_for(listening(), 60)
        pump = asyncio.create_task(proc.stderr.read())  # keep its stderr flowing; only stdout is left unread
        model = s.backend.engine.model_name
        body = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "fill the pipe"}]}
        async with httpx.AsyncClient(timeout=15) as c:
            for i in range(60):  # ~400 bytes of access log each: 6x what the pipe holds
                r = await c.post(http + "/v1/chat/completions", json=body)
                assert r.status_code == 200, (i, r.text)
            metrics = (await c.get(admin + "/metrics")).text
        # 24 KB is well under the backlog's cap: nothing is lost, the lines wait for the reader.
        dropped = re.search(r'affinity_proxy_access_log_lines_total\{outcome="dropped"\} (\S+)', metrics)
        assert dropped is not None and float(dropped[1]) == 0, metrics[-2000:]
        os.set_blocking(read_end, False)
        got = bytearray()
        deadline = time.monotonic() + 20
        while got.count(b"\n") < 60 and time.monotonic() < deadline:  # the reader catches up at last
            try:
                got += os.read(read_end, 1 << 16)
            except BlockingIOError:
                await asyncio.sleep(0.1)
        lines = [json.loads(line) for line in got.splitlines()]  # whole lines
        assert len(lines) == 60 and {(x["path"], x["status"]) for x in lines} == {("/v1/chat/completions", 200)}
    finally:
        if proc.returncode is None:
            proc.terminate()
        os.close(read_end)  # (a proxy still writing gets EPIPE, not a hang)
        await asyncio.wait_for(proc.wait(), 30)
        if "pump" in locals():
            pump.cancel()
