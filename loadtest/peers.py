"""The peer LLM routers, sglang-router and vllm-router (Rust, from PyPI), in front of the same simulated fleet.

    python -m loadtest.peers install          # peers-venv/ (gitignored): pip install sglang-router vllm-router
    python -m loadtest.peers check            # start each against a 2-server fleet and send one request

They live in their own virtual environment because they pin their own dependencies and are not part of
the proxy. What they ask of a worker (server/model info naming a local tokenizer folder, /get_load,
/tokenize and the render endpoints) the simulator answers; see ../shared/peers/README.md. Both bind to
0.0.0.0 unless given host flags, so every launch here passes --host and --prometheus-host 127.0.0.1 and a
prometheus port of its own.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import venv
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from loadtest.harness import REPO, Proc, free_port, spawn, wait_http

VENV = REPO / "peers-venv"
PACKAGES = ("sglang-router", "vllm-router")


@dataclass(frozen=True)
class Peer:
    kind: str  # "sglang" | "vllm"
    policy: str  # round_robin | cache_aware | ...

    @property
    def label(self) -> str:
        return f"{'sglang-router' if self.kind == 'sglang' else 'vllm-router'} {self.policy}"


def parse_peers(spec: str) -> list[Peer]:
    """``sglang:round_robin,sglang:cache_aware,vllm:cache_aware``."""
    out = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        kind, _, policy = part.partition(":")
        if kind not in ("sglang", "vllm") or not policy:
            raise ValueError(f"peer {part!r}: expected sglang:POLICY or vllm:POLICY")
        out.append(Peer(kind, policy))
    return out


def venv_python() -> Path:
    return VENV / "bin" / "python"


def installed() -> dict[str, str | None]:
    """Installed version of each peer package in peers-venv, None when missing."""
    if not venv_python().exists():
        return {p: None for p in PACKAGES}
    out: dict[str, str | None] = {}
    for p in PACKAGES:
        r = subprocess.run([str(venv_python()), "-m", "pip", "show", p], capture_output=True, text=True)
        version = next((ln.split(":", 1)[1].strip() for ln in r.stdout.splitlines() if ln.startswith("Version:")), None)
        out[p] = version
    return out


def install() -> tuple[bool, str]:
    """Create peers-venv and install both routers; (ok, pip's last lines) so a failure says exactly why."""
    if not venv_python().exists():
        venv.EnvBuilder(with_pip=True).create(VENV)
    r = subprocess.run(
        [str(venv_python()), "-m", "pip", "install", "--disable-pip-version-check", *PACKAGES],
        capture_output=True, text=True,
    )
    tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-15:])
    return r.returncode == 0, tail


def command(peer: Peer, port: int, prom_port: int, worker_urls: Sequence[str]) -> list[str]:
    if peer.kind == "sglang":
        return [
            str(venv_python()), "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom_port),
            "--worker-urls", *worker_urls, "--policy", peer.policy, "--log-level", "warn",
        ]
    return [
        str(VENV / "bin" / "vllm-router"), "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom_port),
        "--worker-urls", *worker_urls, "--policy", peer.policy, "--log-level", "warning",
    ]


async def start_peer(peer: Peer, worker_urls: Sequence[str], workdir: Path, timeout_s: float = 90.0) -> Proc:
    port, prom = free_port(), free_port()
    name = f"{peer.kind}-{peer.policy}"
    proc = spawn(name, command(peer, port, prom, worker_urls), workdir)
    proc.info = {"url": f"http://127.0.0.1:{port}", "prometheus": f"http://127.0.0.1:{prom}"}
    await wait_http(proc.info["url"] + "/v1/models", proc, timeout_s)
    return proc


async def _check(peers: list[Peer]) -> int:
    from loadtest.harness import FleetSpec, start_fleet_process, temp_workdir

    workdir = temp_workdir("peers-check-")
    fleet = await start_fleet_process(FleetSpec(backends=2, max_model_len=None), workdir)
    failures = 0
    try:
        urls = [s["url"] for s in fleet.info["servers"]]
        import aiohttp

        for peer in peers:
            try:
                proc = await start_peer(peer, urls, workdir)
            except RuntimeError as exc:
                print(f"{peer.label}: did not start: {exc}")
                failures += 1
                continue
            try:
                async with aiohttp.ClientSession() as s:
                    async with s.post(proc.info["url"] + "/v1/completions", json={
                        "model": "llama3-8b", "prompt": "hello there " * 20, "max_tokens": 8, "stream": True,
                        "ignore_eos": True}) as resp:
                        body = await resp.text()
                        print(f"{peer.label}: HTTP {resp.status}, {body.count('data:')} SSE events, "
                              f"x-sim-backend={resp.headers.get('x-sim-backend')}")
                        failures += resp.status != 200
            finally:
                proc.stop()
    finally:
        fleet.stop()
    print(f"logs in {workdir}")
    return failures


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m loadtest.peers")
    ap.add_argument("cmd", choices=("install", "status", "check"))
    ap.add_argument("--peers", default="sglang:round_robin,sglang:cache_aware,vllm:round_robin,vllm:cache_aware")
    args = ap.parse_args(argv)
    if args.cmd == "install":
        ok, tail = install()
        print(tail)
        print(json.dumps(installed()))
        sys.exit(0 if ok else 1)
    if args.cmd == "status":
        print(json.dumps(installed()))
        return
    import uvloop

    sys.exit(1 if uvloop.run(_check(parse_peers(args.peers))) else 0)


if __name__ == "__main__":
    main()
