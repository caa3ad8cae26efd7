"""`until` itself: it returns as soon as the condition holds, takes async predicates, and fails, naming what
it waited for, instead of hanging."""

from __future__ import annotations

import asyncio

import pytest

from tests.support import until


async def test_returns_the_first_truthy_value_as_soon_as_it_appears() -> None:
    calls: list[int] = []

    def predicate() -> list[int] | None:
        calls.append(1)
        return calls if len(calls) == 3 else None

    assert await until(predicate, interval=0) == [1, 1, 1]
    assert len(calls) == 3


async def test_awaits_async_predicates() -> None:
    ready = asyncio.Event()
    asyncio.get_running_loop().call_later(0.02, ready.set)

    async def predicate() -> bool:
        await asyncio.sleep(0)
        return ready.is_set()

    assert await until(predicate, timeout=5) is True


async def test_fails_with_what_it_waited_for_and_the_last_value() -> None:
    with pytest.raises(AssertionError, match=r"not reached within 0.05 s: the door opens \(last value: 0\)"):
        await until(lambda: 0, timeout=0.05, message="the door opens")


async def test_names_the_predicate_when_no_message_is_given() -> None:
    def door_is_open() -> bool:
        return False

    with pytest.raises(AssertionError, match="door_is_open"):
        await until(door_is_open, timeout=0.02)


async def test_a_callable_message_describes_the_state_when_the_wait_gives_up() -> None:
    state = {"door": "shut"}
    asyncio.get_running_loop().call_later(0.01, state.update, {"door": "jammed"})
    with pytest.raises(AssertionError, match=r"not reached within 0.05 s: the door is jammed \(last value: 0\)"):
        await until(lambda: 0, timeout=0.05, message=lambda: f"the door is {state['door']}")
