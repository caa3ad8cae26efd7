"""A metrics endpoint whose page, status and delay a test sets at will."""

from __future__ import annotations

import asyncio

from aiohttp import web


class FakeMetrics:
    def __init__(self, page: str = "", status: int = 200, delay_s: float = 0.0) -> None:
        self.page = page
        self.status = status
        self.delay_s = delay_s
        self.hits = 0
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def _metrics(self, request: web.Request) -> web.Response:
        self.hits += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return web.Response(text=self.page, status=self.status, content_type="text/plain")

    async def start(self) -> "FakeMetrics":
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


def agent_page(mem_used: float = 40e9, mem_total: float = 80e9, queue: float = 0, kv_rate: float = 0) -> str:
    return (
        f"gpu_memory_used_bytes {mem_used}\ngpu_memory_total_bytes {mem_total}\n"
        f"cuda_kernel_queue_length {queue}\nkvcache_tokens_per_second {kv_rate}\n"
    )
