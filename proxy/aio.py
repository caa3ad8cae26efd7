"""Small asyncio helpers shared by the adapters at the edges (never imported by proxy/core)."""

from __future__ import annotations

import asyncio
from typing import Any


async def cancel_and_wait(task: asyncio.Future[Any] | None) -> None:
    """Cancel a background task and wait until it has finished, whatever it ended with.

    Unlike `task.cancel(); try: await task except CancelledError: pass`, a cancellation of the caller
    itself (a stop() that is cancelled while it waits) is not swallowed: only the task's own ending is.
    """
    if task is None:
        return
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
