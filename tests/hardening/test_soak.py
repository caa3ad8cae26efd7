"""CI's two-minute soak (loadtest/soak.py): mixed load, every kind of fault, no unexplained failure, no growth.

It runs the soak as its own process (`python -m loadtest.soak`, what an operator runs), not inside the
test process, so that state left by earlier tests in the pytest process cannot change what it measures.

This run used to hang after ~75 s: the soak read one line (the ports) from its proxy child's stdout and
never read the access log that followed, the pipe filled and the proxy's blocking access-log write froze
its event loop. The soak now reads that stdout for the whole run, the access log never blocks on a full
pipe (tests/observability/test_access_log.py, test_proxy_access_log.py), and a proxy that stops answering
is reported as a stall instead of being waited for.

The one-hour run and its plot are in loadtest/results/soak.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FAULT_KINDS = {"kill", "stall", "burst_5xx", "reload_valid", "reload_invalid", "disconnect_storm"}


@pytest.mark.timeout(240)
def test_two_minute_soak(tmp_path: Path) -> None:
    out = tmp_path / "soak"
    run = subprocess.run(
        [sys.executable, "-m", "loadtest.soak", "--duration", "104", "--rate", "4", "--sample-s", "5",
         "--fault-every-s", "12", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=230,
    )
    assert (out.with_suffix(".json")).exists(), run.stderr[-3000:]
    report = json.loads(out.with_suffix(".json").read_text())
    verdict = report["verdict"]
    assert {f["kind"] for f in report["faults"]} == FAULT_KINDS
    sent = sum(c["sent"] for c in verdict["requests"].values())
    assert sent >= 400
    assert set(verdict["requests"]) == {"http_unary", "http_stream", "grpc_unary", "grpc_stream"}
    assert len(report["samples"]) >= 20  # one every 5 s to the end: the proxy answered all along
    assert verdict["stalls"] == [], verdict["stalls"]
    assert verdict["unexplained_failures"] == [], verdict["unexplained_failures"]
    assert set(verdict["growth"]) == {"rss_mib", "fds", "sockets", "tasks"}
    assert not any(g["grew"] for g in verdict["growth"].values()), verdict["growth"]
    assert verdict["access_log_lines"] >= sent  # its stdout was read: a line per request (and the storm's)
    assert verdict["ok"], verdict
    assert run.returncode == 0, run.stderr[-3000:]
