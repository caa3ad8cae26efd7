"""Small async helpers shared by the resilience tests: a controllable fake backend and bounded waits."""

from __future__ import annotations

import asyncio
import socket
from typing import Callable

from aiohttp import web


async def until(predicate: Callable[[], bool], timeout: float = 10.0, step: float = 0.01) -> None:
    """Wait for a condition; fail (not hang) if it never holds. The bound is a safety net, not a measurement."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():
        if loop.time() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(step)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeBackend:
    """An HTTP server whose /health answer the test controls: ok, fail (503) or stall for `stall_s`."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.stall_s = 0.0
        self.health_calls = 0
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def _health(self, request: web.Request) -> web.Response:
        self.health_calls += 1
        if self.stall_s:
            await asyncio.sleep(self.stall_s)
        if self.mode == "fail":
            return web.Response(status=503, text="no")
        return web.Response(text="ok")

    async def start(self, port: int = 0) -> str:
        app = web.Application()
        app.router.add_get("/health", self._health)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", port)
        await site.start()
        self.port = self.runner.addresses[0][1]
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


def established_to(port: int) -> int:
    """Established TCP connections whose remote end is 127.0.0.1:`port` (client side), from /proc/net/tcp."""
    count = 0
    with open("/proc/net/tcp") as fh:
        next(fh)
        for line in fh:
            fields = line.split()
            remote, state = fields[2], fields[3]
            if state == "01" and remote == f"0100007F:{port:04X}":
                count += 1
    return count
