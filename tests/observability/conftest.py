"""Fixtures of the observability tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture
def screenshot_dir(tmp_path: Path) -> Path:
    """Where a browser test saves its screenshot: the test's own folder, so that a run leaves the checkout as
    it found it, or $AFFINITY_PROXY_SCREENSHOTS (e.g. loadtest/results, to refresh the committed ones)."""
    where = os.environ.get("AFFINITY_PROXY_SCREENSHOTS")
    if where:
        Path(where).mkdir(parents=True, exist_ok=True)
        return Path(where)
    return tmp_path
