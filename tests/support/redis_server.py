"""A real `redis-server` on 127.0.0.1 for the tests of routing.peer_load (Debian package `redis-server`).

Without the binary the tests skip and say why, except in CI (CI=true), where .ci/run installs it: there a
missing binary fails them, so the peer-load tests can never pass by not running.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from typing import Iterator

import pytest

from tests.support.net import free_port


def redis_binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        reason = "redis-server not installed (apt-get install -y redis-server)"
        if os.environ.get("CI"):
            pytest.fail(f"{reason}; .ci/run installs it in CI")
        pytest.skip(reason)
    return binary


class RedisServer:
    """One redis-server process without persistence; `url` to connect, `stop()`/`start()` to take it away
    and bring it back on the same port."""

    def __init__(self) -> None:
        self.binary = redis_binary()
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()
