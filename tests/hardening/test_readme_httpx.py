"""The README's httpx example for the h2c port runs as written (against the demo's fleet, on a free port)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import re
import textwrap
from pathlib import Path

from proxy.app import AffinityProxy
from proxy.cli import demo_config
from sim.fleet import start_fleet

README = Path(__file__).resolve().parents[2] / "README.md"


def httpx_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    found = [textwrap.dedent(b) for b in blocks if "import httpx" in b]
    assert len(found) == 1, "the README has one httpx example"
    return found[0]


async def test_readme_httpx_example_works_against_the_demo() -> None:
    code = httpx_example()
    assert "127.0.0.1:8081" in code and "http1=False" in code
    fleet = await start_fleet(2, host="127.0.0.1", port=0, grpc_port=0, speed=200.0)
    proxy = AffinityProxy(demo_config([(s.name, s.url, s.grpc_address) for s in fleet.servers], "affinity", 0, 0, 0))
    await proxy.start()
    try:
        assert proxy.grpc is not None
        code = code.replace("127.0.0.1:8081", f"127.0.0.1:{proxy.grpc.port}")  # the demo's port, made free
        out = io.StringIO()

        def run() -> None:
            with contextlib.redirect_stdout(out):
                exec(compile(code, "README.md", "exec"), {})  # noqa: S102 - the documented example itself

        await asyncio.to_thread(run)
        version, _, text = out.getvalue().strip().partition(" ")
        assert version == "HTTP/2" and text
    finally:
        await proxy.stop()
        await fleet.stop()
