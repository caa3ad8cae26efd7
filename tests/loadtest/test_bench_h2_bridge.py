"""The in-process HTTP/2 bridge benchmark measures what it says: every request it sends is answered, with
this tree's ways and with each of h2's/hpack's own put back (`--ablate`).

It runs the bridge's Python source (its stand-ins are refused by the compiled modules, proxy/native), so it
is run here as it is run by hand: a process of its own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_round_answers_every_request_with_each_ablation() -> None:
    # one_round raises SystemExit unless every request (including a last partial batch) ended its stream.
    r = subprocess.run([sys.executable, "loadtest/bench_h2_bridge.py", "--requests", "50", "--rounds", "2",
                        "--ablate", "encoder+decoder", "--ablate", "headers", "--ablate", "whole", "--ablate", "fast"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    medians = [line for line in r.stdout.splitlines() if line.startswith("median ")]
    assert len(medians) == 5 and all(float(line.split(": ")[1].split(" ")[0]) > 0 for line in medians), r.stdout
