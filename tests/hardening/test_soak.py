"""CI's two-minute soak (loadtest/soak.py): mixed load, every kind of fault, no unexplained failure, no growth.

The one-hour run and its plot are in loadtest/results/soak.md.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.soak import Soak, run_soak


@pytest.mark.timeout(300)
async def test_two_minute_soak(tmp_path: Path) -> None:
    soak = Soak(duration_s=100, rate=4, sample_s=5, fault_every_s=12)
    verdict = await run_soak(soak, tmp_path)
    assert {f.kind for f in soak.faults} == {"kill", "stall", "burst_5xx", "reload_valid", "reload_invalid",
                                             "disconnect_storm"}
    assert sum(c["sent"] for c in verdict["requests"].values()) >= 300
    assert set(verdict["requests"]) == {"http_unary", "http_stream", "grpc_unary", "grpc_stream"}
    assert len(soak.samples) >= 15
    assert verdict["ok"], verdict
