"""loadtest.steady for a few seconds at a low rate: the real proxy process, the fake backends, the open-loop
generator, and the shape of what it writes (no timing is asserted beyond what the backend's pacing forces)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _steady(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "loadtest.steady", "--proxy-core", "", "--load-core", "",
         "--out", str(tmp_path / "steady"), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=180,
    )


def test_steady_ramp_then_hold_unary_and_a_fixed_stream_rate(tmp_path: Path) -> None:
    # Unary: a two-step ramp (20/s, 30/s; 45/s is past --ramp-max), then 90 % of the knee for 3 s.
    unary = _steady(tmp_path, "--mode", "unary", "--duration", "3", "--ramp-start", "20", "--ramp-max", "40",
                    "--factor", "1.5", "--step-s", "1")
    assert unary.returncode == 0, unary.stdout + unary.stderr
    assert "ramp     20.0/s" in unary.stdout and "hold " in unary.stdout
    # Stream: no ramp, 10 streams/s of 5 events 20 ms apart.
    stream = _steady(tmp_path, "--mode", "stream", "--duration", "3", "--rate", "10", "--events", "5",
                     "--event-interval-ms", "20")
    assert stream.returncode == 0, stream.stdout + stream.stderr

    data = json.loads((tmp_path / "steady.json").read_text())
    assert set(data) == {"unary", "stream"}  # the second run kept the first one's entry
    u, s = data["unary"], data["stream"]

    assert [step["rate"] for step in u["ramp"]][:1] == [20.0] and u["knee"] >= 20.0
    assert u["rate"] == round(u["knee"] * 0.9, 1)
    sent = u["total"]["sent"]
    assert abs(sent - u["rate"] * 3) <= 1  # open loop: the count is the rate, whatever the answers did
    assert u["total"]["ok"] == sent and u["total"]["errors"] == 0 and u["held"]
    assert len(u["minutes"]) == 1
    for key in ("sent", "ok", "errors", "p50_ms", "p99_ms"):
        assert key in u["minutes"][0]
    assert 0 < u["total"]["p50_ms"] <= u["total"]["p99_ms"]

    assert s["knee"] is None and s["rate"] == 10.0 and s["events"] == 5 and s["ramp"] == []
    assert s["total"]["sent"] == 30 and s["total"]["ok"] == 30
    # The events really were relayed one by one: a stream lasts at least its backend's pacing (4 gaps of
    # 20 ms after the first event) and its first event arrives before its end.
    assert s["total"]["p50_ms"] >= 75
    assert s["total"]["ttfb_p50_ms"] < s["total"]["p50_ms"]

    md = (tmp_path / "steady.md").read_text()
    assert "## unary: non-streaming" in md and "## stream: streaming" in md
    assert "| minute | sent | ok | errors | p50 ms | p99 ms |" in md
    assert "| rate/s | ok | errors |" in md  # the unary ramp table
    assert (tmp_path / "steady.png").stat().st_size > 1000
