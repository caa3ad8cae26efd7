"""One bounded wait for a condition that something else (a task, a server, a subprocess) makes true."""

from __future__ import annotations

import asyncio
import inspect
from typing import Awaitable, Callable, TypeVar

T = TypeVar("T")


async def until(predicate: Callable[[], T | Awaitable[T]], timeout: float = 10.0, interval: float = 0.01,
                message: str | Callable[[], str] = "") -> T:
    """Call `predicate` (plain or async) every `interval` seconds until it returns something truthy, and
    return that. After `timeout` seconds fail with an AssertionError naming `message` (or the predicate)
    and its last value, rather than hang; a callable `message` is called then, so it can describe the
    state the wait gave up on. The bound is a hang guard, never what a test measures: pick it
    generously, the wait ends as soon as the condition holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]  # an awaitable predicate's awaited value is a T
        if loop.time() >= deadline:
            what = (message() if callable(message) else message) or getattr(predicate, "__qualname__", repr(predicate))
            raise AssertionError(f"not reached within {timeout} s: {what} (last value: {value!r})")
        await asyncio.sleep(interval)
