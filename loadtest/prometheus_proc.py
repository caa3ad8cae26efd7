"""Start Debian's `prometheus` binary for a test or a demo: one scrape target, 1 s scrape interval."""

from __future__ import annotations

import asyncio
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

PROMETHEUS = "/usr/bin/prometheus"


def prometheus_binary() -> str | None:
    if Path(PROMETHEUS).exists():
        return PROMETHEUS
    return shutil.which("prometheus")


@dataclass
class PrometheusProcess:
    proc: asyncio.subprocess.Process
    url: str
    log_path: Path

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except asyncio.TimeoutError:
                self.proc.kill()
                await self.proc.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def start_prometheus(target: str, data_dir: Path, *, scrape_interval_s: float = 1.0,
                           timeout_s: float = 30.0) -> PrometheusProcess:
    """Prometheus on a free loopback port scraping http://`target`/metrics; waits until it is ready."""
    binary = prometheus_binary()
    if binary is None:
        raise FileNotFoundError("no prometheus binary (Debian package `prometheus`)")
    data_dir.mkdir(parents=True, exist_ok=True)
    config = data_dir / "prometheus.yml"
    every = f"{int(round(scrape_interval_s * 1000))}ms"  # Prometheus durations are integers with a unit
    config.write_text(
        f"global:\n  scrape_interval: {every}\n  evaluation_interval: {every}\n"
        f"scrape_configs:\n  - job_name: affinity-proxy\n    scrape_interval: {every}\n"
        f"    scrape_timeout: {every}\n    static_configs:\n      - targets: ['{target}']\n")
    port = _free_port()
    log_path = data_dir / "prometheus.log"
    log = log_path.open("wb")
    proc = await asyncio.create_subprocess_exec(
        binary, f"--config.file={config}", f"--storage.tsdb.path={data_dir / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h",
        stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log)
    log.close()
    prom = PrometheusProcess(proc, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while True:
            if proc.returncode is not None:
                raise RuntimeError(f"prometheus exited {proc.returncode}: {log_path.read_text()[-2000:]}")
            try:
                async with s.get(prom.url + "/-/ready") as resp:
                    if resp.status == 200:
                        return prom
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                await prom.stop()
                raise TimeoutError(f"prometheus not ready after {timeout_s:.0f}s")
            await asyncio.sleep(0.2)
