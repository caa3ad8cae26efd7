"""Fixtures shared by the resilience tests that run a real proxy in front of fake backends."""

from __future__ import annotations

from typing import AsyncIterator

import pytest

from tests.support import FakeBackend


@pytest.fixture
async def fakes() -> AsyncIterator[list[FakeBackend]]:
    out = [FakeBackend(f"b{i}") for i in range(3)]
    for f in out:
        await f.start()
    yield out
    for f in out:
        await f.stop()
