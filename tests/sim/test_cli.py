"""`python -m sim` as a user runs it: ports printed, HTTP and gRPC answer, SIGTERM stops it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import httpx

from proxy.protos import generate_pb2

ROOT = Path(__file__).resolve().parents[2]


def test_fleet_runner_serves_http_and_grpc_and_stops_on_sigterm() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "sim", "--host", "127.0.0.1", "--port", "0", "--servers", "2",
         "--grpc-port", "0", "--flavor", "vllm,tgi", "--speed", "100"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
    )
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline().split() for _ in range(2)]
        assert [line[0] for line in lines] == ["sim-0", "sim-1"]
        urls = [line[1] for line in lines]
        grpcs = [line[2].removeprefix("grpc=") for line in lines]
        assert "flavor=tgi" in lines[1]
        for url in urls:
            assert httpx.get(url + "/health", timeout=5).status_code == 200
        assert "tgi_queue_size" in httpx.get(urls[1] + "/metrics", timeout=5).text
        with grpc.insecure_channel(grpcs[0]) as channel:
            call = channel.unary_stream(
                "/affinity.v1.Generation/GenerateStream",
                request_serializer=generate_pb2.GenerateRequest.SerializeToString,
                response_deserializer=generate_pb2.GenerateResponse.FromString,
            )
            msgs = list(call(generate_pb2.GenerateRequest(prompt="a b c", max_tokens=4, ignore_eos=True), timeout=10))
        assert msgs[-1].finished and msgs[-1].usage.completion_tokens == 4
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=10)
        assert proc.returncode == 0, err
        assert "stopped" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_bad_flavor_is_a_usage_error() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "sim", "--port", "0", "--flavor", "nginx"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=30)
    assert r.returncode == 2 and "unknown --flavor" in r.stderr
