"""Processes a comparison runs: a simulated fleet, the proxy, the peer routers; each started fresh and stopped
by its pid.

The fleet and every router get their own process so that, on a two-core machine, the load generator, the
router under test and the simulated GPUs do not share one event loop: a router's cost then shows up as
its own CPU time (reported per request) instead of as latency added to the simulator.

    python -m loadtest.harness fleet --backends 4 --max-model-len 131072   # prints one JSON line, runs until SIGTERM
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import aiohttp

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    """A child process we started; `stop` ends it (SIGTERM, then SIGKILL) by its pid only."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        if self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(5)

    def tail(self, n: int = 2000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""


def spawn(name: str, argv: Sequence[str], workdir: Path, env: dict[str, str] | None = None) -> Proc:
    log = workdir / f"{name}.log"
    fh = log.open("wb")
    popen = subprocess.Popen(
        list(argv), stdout=fh, stderr=subprocess.STDOUT, cwd=str(REPO),
        env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **(env or {})},
    )
    fh.close()
    return Proc(name, popen, log)


async def wait_http(url: str, proc: Proc, timeout_s: float = 60.0, ok: tuple[int, ...] = (200,)) -> None:
    """Poll `url` until it answers one of `ok`; fail early (with the log's tail) if the process died."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while True:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.tail()}")
            try:
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as resp:
                    if resp.status in ok:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{proc.name} not ready at {url} after {timeout_s:.0f} s:\n{proc.tail()}")
            await asyncio.sleep(0.2)


# ------------------------------------------------------------------------------------------------ fleet


@dataclass(frozen=True)
class FleetSpec:
    backends: int = 4
    profile: str = "llama3-8b-h100"
    max_model_len: int | None = 131072
    speed: float = 1.0
    model_name: str = "llama3-8b"
    seed: int = 0
    adapters: tuple[str, ...] = ()
    profile_sets: tuple[str, ...] = ()  # KEY=VALUE overrides of Profile fields


async def start_fleet_process(spec: FleetSpec, workdir: Path) -> Proc:
    argv = [
        PYTHON, "-m", "loadtest.harness", "fleet", "--backends", str(spec.backends), "--profile", spec.profile,
        "--speed", str(spec.speed), "--model-name", spec.model_name, "--seed", str(spec.seed),
    ]
    if spec.max_model_len:
        argv += ["--max-model-len", str(spec.max_model_len)]
    for a in spec.adapters:
        argv += ["--lora", a]
    for kv in spec.profile_sets:
        argv += ["--profile-set", kv]
    proc = spawn("fleet", argv, workdir)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"fleet exited:\n{proc.tail()}")
        for line in proc.log.read_text(errors="replace").splitlines():
            if line.startswith("{") and '"servers"' in line:
                proc.info = json.loads(line)
                for s in proc.info["servers"]:
                    await wait_http(s["url"] + "/health", proc)
                return proc
        await asyncio.sleep(0.2)
    proc.stop()
    raise RuntimeError(f"fleet did not start:\n{proc.tail()}")


async def _serve_fleet(args: argparse.Namespace) -> None:
    from loadtest.replay import make_profile, parse_profile_sets
    from sim.fleet import start_fleet

    # max_model_len: Llama-3.1-8B has Llama-3-8B's architecture with a 128k context; long traces need it.
    profile = make_profile(args.profile, args.max_model_len, parse_profile_sets(args.profile_set))
    fleet = await start_fleet(
        args.backends, host="127.0.0.1", port=0, profile=profile, speed=args.speed, seed=args.seed,
        model_name=args.model_name, adapters=tuple(args.lora),
    )
    servers = [{"name": s.name, "url": s.url} for s in fleet.servers]
    factors = {k: getattr(profile, k) for k in ("mfu_prefill", "mbu_decode", "step_overhead_s", "per_seq_overhead_s",
                                                  "gpu_memory_utilization", "max_num_batched_tokens")}
    print(json.dumps({"servers": servers, "pid": os.getpid(), "profile": factors}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await fleet.stop()


# ------------------------------------------------------------------------------------------------ proxy


def proxy_config_yaml(policy: str, backends: Sequence[dict[str, str]], port: int, admin_port: int, *,
                      epsilon: float | None = None, extra: str = "") -> str:
    lines = [
        f"listen: {{host: 127.0.0.1, port: {port}}}",
        f"admin: {{host: 127.0.0.1, port: {admin_port}}}",
        "debug_headers: true",
        f"routing:\n  policy: {policy}",
    ]
    if epsilon is not None:
        lines.append(f"  affinity: {{epsilon: {epsilon}}}")
    lines.append("backends:")
    lines += [f"  - {{name: {b['name']}, url: '{b['url']}'}}" for b in backends]
    if extra:
        lines.append(extra)
    return "\n".join(lines) + "\n"


async def start_proxy_process(policy: str, backends: Sequence[dict[str, str]], workdir: Path, *,
                              epsilon: float | None = None, extra_yaml: str = "") -> Proc:
    port, admin = free_port(), free_port()
    cfg = workdir / f"proxy-{policy}.yaml"
    cfg.write_text(proxy_config_yaml(policy, backends, port, admin, epsilon=epsilon, extra=extra_yaml))
    proc = spawn(f"proxy-{policy}", [PYTHON, "-m", "proxy", "run", "--config", str(cfg), "--workers", "1",
                                     "--log-level", "warning"], workdir)
    proc.info = {"url": f"http://127.0.0.1:{port}", "admin": f"http://127.0.0.1:{admin}", "config": str(cfg)}
    await wait_http(proc.info["url"] + "/v1/models", proc)
    return proc


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m loadtest.harness")
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fleet", help="run a simulated fleet until SIGTERM; prints its servers as one JSON line")
    f.add_argument("--backends", type=int, default=4)
    f.add_argument("--profile", default="llama3-8b-h100")
    f.add_argument("--max-model-len", type=int, default=None)
    f.add_argument("--speed", type=float, default=1.0)
    f.add_argument("--model-name", default="llama3-8b")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--lora", action="append", default=[])
    f.add_argument("--profile-set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    import uvloop

    uvloop.run(_serve_fleet(args))


def temp_workdir(prefix: str = "affinity-loadtest-") -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix))


if __name__ == "__main__":
    main()
