"""Load and slowdowns for the tests that run the real proxy in front of the simulator."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from typing import Any, AsyncIterator

import aiohttp

from proxy.app import AffinityProxy
from sim.fleet import Fleet


class Load:
    """`clients` closed-loop clients sending short chats with distinct prompts until stopped."""

    def __init__(self, proxy: AffinityProxy, model: str, clients: int = 24) -> None:
        self.url = proxy.http_url + "/v1/chat/completions"
        self.model = model
        self.clients = clients
        self.statuses: dict[int, int] = {}
        self._ids = itertools.count()
        self._tasks: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None

    async def _client(self) -> None:
        assert self._session is not None
        while True:
            body = {"model": self.model, "max_tokens": 2,
                    "messages": [{"role": "user", "content": f"request number {next(self._ids)}"}]}
            try:
                async with self._session.post(self.url, json=body) as r:
                    await r.read()
                    self.statuses[r.status] = self.statuses.get(r.status, 0) + 1
            except aiohttp.ClientError:
                await asyncio.sleep(0.01)

    async def __aenter__(self) -> "Load":
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self.clients))
        self._tasks = [asyncio.create_task(self._client()) for _ in range(self.clients)]
        return self

    async def __aexit__(self, *exc: Any) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        assert self._session is not None
        await self._session.close()


@contextlib.asynccontextmanager
async def slowed(fleet: Fleet, names: tuple[str, ...], stall_ms: float = 400.0,
                 every_s: float = 0.45) -> AsyncIterator[None]:
    """Stall faults on `names`, renewed every `every_s` (a slowdown, not a dead backend), through the
    simulator's own control endpoint, POST /sim/faults."""

    async def stall_forever(session: aiohttp.ClientSession, url: str) -> None:
        while True:
            async with session.post(url + "/sim/faults", json={"stall_ms": stall_ms}) as r:
                assert r.status == 200, await r.text()
            await asyncio.sleep(every_s)

    async with aiohttp.ClientSession() as session:
        servers = [fleet.by_name(n) for n in names]
        tasks = [asyncio.create_task(stall_forever(session, s.url)) for s in servers if s is not None]
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for s in servers:
                if s is not None:
                    async with session.post(s.url + "/sim/faults", json={"stall_ms": 0}) as r:
                        assert r.status == 200
