"""Smaller findings of issue 18: health log levels, a busy port named in one line."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.control.checks import HealthMonitor
from proxy.control.store import SnapshotStore
from proxy.core.health import CheckResult, HealthCheckConfig, HealthChange, OutlierConfig
from proxy.core.snapshot import BackendSpec, Health, Snapshot

CLI = str(Path(sys.executable).with_name("affinity-proxy"))


def test_health_transitions_log_once_healthy_at_info_unhealthy_at_warning(caplog: pytest.LogCaptureFixture) -> None:
    store = SnapshotStore(Snapshot.initial([BackendSpec("a", "http://127.0.0.1:9")]))
    checks = HealthCheckConfig(interval_ms=20, healthy_threshold=1, unhealthy_threshold=1)
    monitor = HealthMonitor(store, checks, OutlierConfig())
    with caplog.at_level(logging.DEBUG, logger="affinity_proxy.health"):
        monitor.on_check("a", CheckResult.PASS, 1.0)
        monitor.on_check("a", CheckResult.FAIL, 1.0)
        # The same transition reported again by a second path (with --workers, the supervisor hears about
        # a backend from its checks and from its workers' outcomes): still one line.
        monitor._apply(HealthChange("a", Health.UNHEALTHY, "check_fail"))  # noqa: SLF001
        monitor.on_check("a", CheckResult.FAIL, 1.0)
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if "is now" in r.getMessage()]
    assert [(lvl, msg.split(" (")[0]) for lvl, msg in lines] == [
        (logging.INFO, "backend a is now healthy"),
        (logging.WARNING, "backend a is now unhealthy"),
    ]


def _busy_port() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def test_demo_on_a_busy_port_says_so_in_one_line_naming_the_flag() -> None:
    with _busy_port() as s:
        port = s.getsockname()[1]
        r = subprocess.run([CLI, "demo", "--backends", "1", "--port", str(port), "--admin-port", "0",
                            "--grpc-port", "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert f"127.0.0.1:{port}" in lines[0] and "--port" in lines[0] and "Traceback" not in r.stderr


def test_run_on_a_busy_port_names_the_setting(tmp_path: Path) -> None:
    with _busy_port() as s:
        port = s.getsockname()[1]
        cfg = tmp_path / "c.yaml"
        cfg.write_text(f"listen: {{port: 0}}\nadmin: {{port: {port}}}\ntelemetry: {{enabled: false}}\n"
                       "health_checks: {enabled: false}\nbackends:\n  - {name: a, url: 'http://127.0.0.1:9'}\n")
        r = subprocess.run([CLI, "run", "-c", str(cfg), "--workers", "1", "--log-level", "error"],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert f":{port}" in last and "admin.port" in last and str(cfg) in last
