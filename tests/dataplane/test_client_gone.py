"""A client that leaves while its answer is on the way (issue 19's side-by-side run found it: 72 requests
logged as 500 `internal_error` at the end of every wrk run). When the backend's answer arrives after the
client's connection started closing but before the proxy heard of it (`connection_lost` comes a loop turn
later), the first write raised a ConnectionResetError: a whole answer was logged as the proxy's own 500 (a
failure in the hot-spot windows), and a streamed one's head was taken for a backend failure: a 502 and an
outlier report against a healthy backend, and a retry elsewhere for nobody. Now both are the 499
`client_gone` a cancellation gives, and the backend hears nothing.

Driven through the real HTTP/1.1 data plane with a client transport the test closes at the right moment,
and a real aiohttp backend that holds its answer until then."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.app import AffinityProxy
from proxy.config import parse_config
from proxy.core.decision import Outcome
from tests.support import until


class _Client(asyncio.Transport):
    """The client's side of one connection: what the proxy writes, and whether it is closing."""

    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.closing = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 40000) if name == "peername" else default

    def write(self, data: Any) -> None:
        self.out += data

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.closing = True

    def can_write_eof(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return 0

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_client_leaving_as_its_answer_arrives_is_a_499_and_no_backend_failure(
        tmp_path: Path, stream: bool) -> None:
    reached, release = asyncio.Event(), asyncio.Event()

    async def completions(request: web.Request) -> web.StreamResponse:
        reached.set()
        await release.wait()
        if not stream:
            return web.json_response({"id": "c", "object": "text_completion", "choices": [{"text": "hi"}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"text": "hi"}]}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    backend = TestServer(app, host="127.0.0.1")
    await backend.start_server()
    log_path = tmp_path / "access.log"
    outcomes: list[tuple[str, Outcome]] = []
    proxy = AffinityProxy(parse_config(
        "listen: {host: 127.0.0.1, port: 0}\nadmin: {host: 127.0.0.1, port: 0}\ntelemetry: {enabled: false}\n"
        "health_checks: {enabled: false}\n"
        f"logging: {{access_log: {{path: '{log_path}', flush_interval_s: 0}}}}\n"
        f"backends:\n  - {{name: b0, url: 'http://127.0.0.1:{backend.port}'}}\n"), on_outcome=lambda b, o: outcomes.append((b, o)))
    await proxy.start()
    try:
        assert proxy.http is not None
        client = _Client()
        protocol = proxy.http.protocol()
        protocol.connection_made(client)
        body = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 4, "stream": stream}).encode()
        protocol.data_received(b"POST /v1/completions HTTP/1.1\r\nHost: p\r\nContent-Type: application/json\r\n"
                               b"x-request-id: gone-1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await asyncio.wait_for(reached.wait(), 10)
        client.closing = True  # the client's connection is closing; connection_lost has not come yet
        release.set()
        assert await until(lambda: protocol.task is None, timeout=10)
        assert not client.out  # nothing was written to the departed client
        # The backend answered: no failure reported against it (a whole answer is its success).
        assert [o for _, o in outcomes if o is not Outcome.SUCCESS] == []
        assert "upstream_unreachable" not in proxy.metrics._errors
        assert await until(lambda: log_path.exists() and "gone-1" in log_path.read_text(), timeout=5)
        (line,) = [json.loads(x) for x in log_path.read_text().splitlines() if "gone-1" in x]
        assert (line["status"], line["error"], line["backend"], line["attempts"]) == (499, "client_gone", "b0", 1)
    finally:
        await proxy.stop()
        await backend.close()
