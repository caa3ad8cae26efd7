"""CI's smoke of every fuzz target: each runs for a few seconds under atheris and finds nothing.

The long runs (>= 1,000,000 inputs per target) and their numbers are in loadtest/results/fuzz.md.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.fuzz.targets import TARGETS

REPO = Path(__file__).resolve().parents[2]


# A few seconds each on an idle machine (inputs per second differ a hundredfold between targets).
RUNS = {"http1": 3000, "h2": 5000, "config": 5000, "metrics": 10000, "response": 30000, "summary": 30000,
        "kv_events": 30000, "request_diff": 30000}


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_fuzz_target_smoke(target: str, tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "loadtest.fuzz", target, "--runs", str(RUNS[target]),
                        "--corpus", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=110)
    out = r.stdout + r.stderr
    # atheris prints a crashing input's Python traceback on stdout, libFuzzer's report goes to stderr.
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-1500:]
    assert "DONE" in out and "cov:" in out, out[-3000:]
    assert not list(tmp_path.glob("crash-*")), out[-3000:]
