"""proxy/aio.py: stopping a background task."""

from __future__ import annotations

import asyncio

import pytest

from proxy.aio import cancel_and_wait


async def test_the_task_is_cancelled_and_finished_whatever_it_ended_with() -> None:
    async def forever() -> None:
        await asyncio.Event().wait()

    async def fails() -> None:
        raise RuntimeError("boom")

    t = asyncio.create_task(forever())
    await asyncio.sleep(0)
    await cancel_and_wait(t)
    assert t.cancelled()
    f = asyncio.create_task(fails())
    await asyncio.sleep(0)
    await cancel_and_wait(f)  # its exception is retrieved, not raised
    assert f.done() and isinstance(f.exception(), RuntimeError)
    await cancel_and_wait(None)


async def test_a_stop_that_is_itself_cancelled_is_not_swallowed() -> None:
    """The pattern it replaces (`try: await task except CancelledError: pass`) ate the caller's own cancel:
    a stop() cancelled while its task ignored cancellation for a moment went on as if nothing happened."""
    release = asyncio.Event()

    async def slow_to_stop() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            await release.wait()  # cleanup that takes a while

    async def stop(task: asyncio.Task[None]) -> str:
        await cancel_and_wait(task)
        return "went on"

    task = asyncio.create_task(slow_to_stop())
    await asyncio.sleep(0)
    stopper = asyncio.create_task(stop(task))
    await asyncio.sleep(0.01)
    stopper.cancel()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await stopper
    await asyncio.sleep(0)
    assert task.done()
