"""Build docker/Dockerfile for real with Debian's podman and run the image against simulated backends.

Opt-in (marker `container`, and AFFINITY_CONTAINER_TESTS=1): it needs root, `apt-get install podman buildah
runc debootstrap uidmap`, and reaches apt and PyPI during the build (3-6 minutes on 2 cores, about 100 s of
them the mypyc compile of the hot path). It follows /work/shared/containers.md (../shared/containers.md
from the repository): podman with its own storage and engine config from the very first command, runc
instead of crun, ulimits this machine allows, a base image debootstrapped locally (no registry) carrying the
machine's CA bundle, substituted through the Dockerfile's BASE_IMAGE argument. Everything it creates
(containers, images, storage) is removed at the end.

The container runs with the host's network and a config bound to 127.0.0.1, so it reaches the simulators
the test starts on loopback; the image's HEALTHCHECK command is run inside it with `podman exec`. The image
must ship the compiled hot path (proxy/native) in use, and none of the compiler's tooling (mypy).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import AsyncIterator, Iterator

import pytest
import yaml

from tests.deploy.files import REPO, Dockerfile, image_config_path, localised_image_config

pytestmark = [
    pytest.mark.container,
    pytest.mark.skipif(os.environ.get("AFFINITY_CONTAINER_TESTS") != "1",
                       reason="container build test: set AFFINITY_CONTAINER_TESTS=1 (needs root and podman)"),
    # The suite's 120 s per test covers fixture setup too, and the image build alone (debootstrap, apt, PyPI,
    # the mypyc compile) takes minutes. pytest-timeout ends the whole process without the fixtures' clean-up,
    # so this guard sits above the sum of the podman/debootstrap timeouts below, which fail and clean up first.
    pytest.mark.timeout(3600),
]

BASE = "localhost/affinity-debian-base:bookworm"
IMAGE = "localhost/affinity-proxy:container-test"
SCRATCH = Path(os.environ.get("AFFINITY_CONTAINER_SCRATCH", "/var/tmp/affinity-container-test"))


def _mirror() -> str:
    for path in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")) + [Path("/etc/apt/sources.list")]:
        if path.exists():
            m = re.search(r"^URIs:\s*(\S+/debian)\s*$", path.read_text(), re.M) or re.search(
                r"^deb\s+(?:\[[^\]]*\]\s+)?(\S+/debian)\s+bookworm", path.read_text(), re.M)
            if m:
                return m.group(1)
    return "http://deb.debian.org/debian"


class Podman:
    """podman with this test's own storage and engine configuration, set before its first command."""

    def __init__(self, root: Path) -> None:
        self.root = root
        storage = root / "storage.conf"
        storage.write_text(
            f'[storage]\ndriver = "overlay"\ngraphroot = "{root / "graph"}"\nrunroot = "{root / "run"}"\n'
        )
        nofile = subprocess.run(["sh", "-c", "ulimit -Hn"], capture_output=True, text=True).stdout.strip()
        containers = root / "containers.conf"
        containers.write_text(
            '[engine]\nruntime = "runc"\n'
            f'[containers]\ndefault_ulimits = ["nofile={nofile}:{nofile}", "nproc=4096:4096"]\n'
        )
        self.env = {**os.environ, "CONTAINERS_STORAGE_CONF": str(storage), "CONTAINERS_CONF": str(containers)}

    def __call__(self, *args: str, timeout: float = 600, check: bool = True, **kw: object) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(["podman", *args], env=self.env, capture_output=True, text=True, timeout=timeout, **kw)
        if check and result.returncode != 0:
            raise AssertionError(f"podman {' '.join(args)} failed ({result.returncode}):\n{result.stdout[-3000:]}\n"
                                 f"{result.stderr[-3000:]}")
        return result


@pytest.fixture(scope="module")
def podman() -> Iterator[Podman]:
    missing = [tool for tool in ("podman", "buildah", "runc", "debootstrap") if shutil.which(tool) is None]
    if missing or os.geteuid() != 0:
        pytest.fail(f"AFFINITY_CONTAINER_TESTS=1 needs root and: apt-get install -y podman buildah runc "
                    f"debootstrap uidmap (missing: {', '.join(missing) or 'root'})")
    if SCRATCH.exists():
        shutil.rmtree(SCRATCH, ignore_errors=True)
    SCRATCH.mkdir(parents=True)
    pm = Podman(SCRATCH)
    try:
        yield pm
    finally:
        pm("ps", "-aq", check=False)
        pm("rm", "-af", "-t", "0", check=False)
        pm("system", "reset", "-f", check=False, timeout=300)
        shutil.rmtree(SCRATCH, ignore_errors=True)


@pytest.fixture(scope="module")
def base_image(podman: Podman) -> str:
    rootfs = SCRATCH / "rootfs"
    subprocess.run(["debootstrap", "--variant=minbase", "bookworm", str(rootfs), _mirror()],
                   check=True, capture_output=True, timeout=900)
    # Outbound TLS from a build goes through this machine's intercepting proxy: trust what the host trusts.
    (rootfs / "etc/ssl/certs").mkdir(parents=True, exist_ok=True)  # minbase has no ca-certificates yet
    shutil.copy("/etc/ssl/certs/ca-certificates.crt", rootfs / "etc/ssl/certs/ca-certificates.crt")
    local_cas = Path("/usr/local/share/ca-certificates")
    if local_cas.is_dir():
        shutil.copytree(local_cas, rootfs / "usr/local/share/ca-certificates", dirs_exist_ok=True)
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    podman("import", "--change", "ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt", "-", BASE, stdin=tar.stdout)
    assert tar.wait() == 0
    shutil.rmtree(rootfs, ignore_errors=True)
    return BASE


@pytest.fixture(scope="module")
def image(podman: Podman, base_image: str) -> str:
    podman("build", "--pull=never", "--build-arg", f"BASE_IMAGE={base_image}", "-f", "docker/Dockerfile",
           "-t", IMAGE, ".", cwd=REPO, timeout=1200)
    return IMAGE


@pytest.fixture
async def fleet() -> AsyncIterator[object]:
    from sim.fleet import start_fleet

    fleet = await start_fleet(4, flavor="vllm", speed=20.0)
    yield fleet
    await fleet.stop()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_image_builds_and_serves(podman: Podman, image: str, fleet: object, tmp_path: Path) -> None:
    import aiohttp

    in_image, shipped = image_config_path()
    http_port, admin_port = _free_port(), _free_port()
    servers = {s.name for s in fleet.servers}  # type: ignore[attr-defined]
    local = tmp_path / "config.yaml"
    local.write_text(localised_image_config(fleet, http_port=http_port, admin_port=admin_port, grpc=False))
    local.chmod(0o644)
    name = "affinity-proxy-container-test"
    # podman blocks; the simulators run on this event loop, so every podman call goes to a thread.
    await asyncio.to_thread(podman, "run", "-d", "--name", name, "--network=host", "-v", f"{local}:{in_image}:ro", image)
    try:
        healthcheck = Dockerfile.parse().healthcheck()
        shipped_admin = yaml.safe_load(shipped.read_text())["admin"]["port"]
        probe = [*healthcheck[:-1], healthcheck[-1].replace(f":{shipped_admin}/", f":{admin_port}/")]
        for _ in range(300):  # a guard against hanging: the proxy starts in a second or two
            if (await asyncio.to_thread(podman, "exec", name, *probe, check=False)).returncode == 0:
                break
            running = await asyncio.to_thread(podman, "inspect", "-f", "{{.State.Running}}", name)
            if running.stdout.strip() != "true":
                break
            await asyncio.sleep(0.2)
        result = await asyncio.to_thread(podman, "exec", name, *probe, check=False)
        assert result.returncode == 0, podman("logs", name, check=False).stderr
        uid = await asyncio.to_thread(podman, "exec", name, "id", "-u")
        assert uid.stdout.strip() == Dockerfile.parse().user().split(":")[0]
        # The image ships the compiled hot path, in use: the status as the image's user sees it, and the line
        # the running proxy logged at start.
        from proxy.native.loader import MODULES, module_name

        status = json.loads((await asyncio.to_thread(podman, "exec", name, "python3", "-m", "proxy.native",
                                                     "status")).stdout)
        assert status["active"] is True and status["native"] == "on", status
        assert set(status["modules"]) == {module_name(rel) for rel in MODULES}, status
        started = await asyncio.to_thread(podman, "logs", name, check=False)
        assert "native hot path: on" in started.stdout + started.stderr, started.stderr[-3000:]
        # ... and not the compiler's tooling, which only the build stage had.
        for module in ("mypy", "mypyc", "mypy_extensions"):
            found = await asyncio.to_thread(podman, "exec", name, "python3", "-c", f"import {module}", check=False)
            assert found.returncode != 0 and "ModuleNotFoundError" in found.stderr, (module, found.stderr)
        model = fleet.servers[0].backend.engine.model_name  # type: ignore[attr-defined]
        async with aiohttp.ClientSession() as session:
            async with session.post(f"http://127.0.0.1:{http_port}/v1/completions",
                                    json={"model": model, "prompt": "from the container", "max_tokens": 4}) as resp:
                assert resp.status == 200, await resp.text()
                assert resp.headers["x-affinity-backend"] in servers
        await asyncio.to_thread(podman, "stop", "-t", "40", name)
        state = podman("inspect", "-f", "{{.State.ExitCode}}", name).stdout.strip()
        assert state == "0", podman("logs", name, check=False).stderr  # SIGTERM drained and exited cleanly
    finally:
        podman("rm", "-f", name, check=False)
