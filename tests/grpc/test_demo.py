"""`affinity-proxy demo` as a newcomer runs it: the gRPC example it prints works as printed."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _banner(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    lines: list[str] = []
    while not lines or "Ctrl-C" not in lines[-1]:
        line = proc.stdout.readline()
        assert line, "demo exited early:\n" + "".join(lines)
        lines.append(line)
    return "".join(lines)


async def test_demo_prints_a_working_grpcio_example(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy", "demo", "--backends", "2", "--port", "0", "--admin-port", "0",
         "--grpc-port", "0"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL,
    )
    try:
        text = await asyncio.to_thread(_banner, proc)
        address = re.search(r"^gRPC\s+(127\.0\.0\.1:\d+)\s", text, re.M)
        assert address is not None, text
        # The heredoc exactly as printed, run by a shell from another directory (as a user would paste it).
        example = re.search(r"^gRPC \(grpcio.*?\n(.*?^PY)$", text, re.M | re.S)
        assert example is not None, text
        script = example.group(1)
        assert address.group(1) in script and "/affinity.v1.Generation/Generate" in script
        outputs = []
        for _ in range(2):
            run = await asyncio.to_thread(subprocess.run, ["bash", "-c", script], capture_output=True, text=True,
                                          timeout=60, cwd=tmp_path)
            assert run.returncode == 0, run.stderr
            outputs.append(run.stdout.split())
        for words in outputs:
            # "<backend> <up to 16 generated tokens>": the call went through the proxy to a simulated backend.
            assert re.fullmatch(r"sim-[01]", words[0]), words
            assert 2 <= len(words) <= 1 + 16, words
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = await asyncio.to_thread(proc.wait, 60)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert code == 0
