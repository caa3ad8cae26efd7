"""The image's own command, run outside a container: ENTRYPOINT + CMD parsed from docker/Dockerfile, with the
config the image ships (docker/config.yaml) in front of simulated backends, probed with the image's own
HEALTHCHECK command.

Only what a container would change is changed (`localised_image_config`): listeners bind 127.0.0.1 on
free ports, and the backends' compose host names (sim-0:8000, ...) become the simulators' loopback
addresses. Everything else in the config is used as shipped.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import AsyncIterator
from urllib.parse import urlsplit

import pytest

from proxy.config import parse_config
from tests.deploy.files import Dockerfile, image_config_path, localised_image_config
from tests.deploy.procs import AFFINITY_PROXY, ProxyProcess, post_json, start_proxy


@pytest.fixture
async def fleet() -> AsyncIterator[object]:
    from sim.fleet import start_fleet

    fleet = await start_fleet(4, flavor="vllm", grpc_port=0, speed=20.0)
    yield fleet
    await fleet.stop()


async def test_the_images_command_serves_with_the_images_config(tmp_path: Path, fleet: object) -> None:
    dockerfile = Dockerfile.parse()
    command = dockerfile.command()
    in_image, shipped = image_config_path()
    config_file = tmp_path / "config.yaml"
    config_file.write_text(localised_image_config(fleet))
    assert parse_config(shipped.read_text()).backends  # (the shipped file itself is checked in test_deploy_files)

    # The image puts the venv's bin first on PATH: `affinity-proxy` there is ours here.
    argv = [AFFINITY_PROXY if command[0] == "affinity-proxy" else command[0]]
    argv += [str(config_file) if arg == in_image else arg for arg in command[1:]]
    proxy: ProxyProcess = await start_proxy(argv)
    try:
        # The image's HEALTHCHECK, pointed at this admin port instead of the container's.
        check = dockerfile.healthcheck()
        admin = urlsplit(proxy.admin)
        shipped_admin = parse_config(shipped.read_text()).admin.port
        script = check[-1].replace(f"127.0.0.1:{shipped_admin}", f"127.0.0.1:{admin.port}")
        assert script != check[-1], "the HEALTHCHECK does not probe the config's admin port"
        interpreter = sys.executable if check[0] in ("python", "python3") else check[0]
        result = subprocess.run([interpreter, *check[1:-1], script], capture_output=True, timeout=30)
        assert result.returncode == 0, result.stderr

        # And it proxies: an OpenAI completion reaches a simulated backend through the shipped routing.
        model = fleet.servers[0].backend.engine.model_name  # type: ignore[attr-defined]
        reply = await post_json(
            proxy.port, "/v1/completions", {"model": model, "prompt": "hello from the image's command", "max_tokens": 4}
        )
        assert reply.status == 200, reply.body
        assert reply.headers["x-affinity-backend"] in {s.name for s in fleet.servers}  # type: ignore[attr-defined]
    finally:
        assert await proxy.terminate() == 0
