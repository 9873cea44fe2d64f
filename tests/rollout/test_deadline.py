"""`Deadline`: asyncio.timeout_at's behaviour with one shared timer per loop."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

from rllm_async.rollout import deadline as deadline_module
from rllm_async.rollout.deadline import Deadline
from rllm_async.vclock import run as vclock_run

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    """On the virtual clock: every timing below is exact."""
    return vclock_run(coro, virtual=True)


def test_a_deadline_raises_timeout_error_at_its_time() -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(TimeoutError), Deadline(start + 5.0) as scope:
            await asyncio.sleep(60)
        assert scope.expired()
        return loop.time() - start

    assert run(main()) == pytest.approx(5.0)


def test_a_scope_left_in_time_does_not_fire_and_leaves_the_task_uncancelled() -> None:
    async def main() -> tuple[bool, int]:
        loop = asyncio.get_running_loop()
        with Deadline(loop.time() + 5.0) as scope:
            await asyncio.sleep(1)
        await asyncio.sleep(10)  # past the deadline: nothing fires
        task = asyncio.current_task()
        assert task is not None
        return scope.expired(), task.cancelling()

    assert run(main()) == (False, 0)


def test_a_scope_left_and_then_rescheduled_stays_left() -> None:
    async def main() -> tuple[bool, int, list[dict[str, Any]]]:
        loop = asyncio.get_running_loop()
        errors: list[dict[str, Any]] = []
        loop.set_exception_handler(lambda loop, context: errors.append(context))
        with Deadline(loop.time() + 5.0) as scope:
            await asyncio.sleep(1)
        scope.reschedule(loop.time() + 1.0)  # as a context moves the scopes it made
        await asyncio.sleep(10)
        task = asyncio.current_task()
        assert task is not None
        return scope.expired(), task.cancelling(), errors

    assert run(main()) == (False, 0, [])


def test_reschedule_moves_the_deadline_and_none_stops_it() -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(TimeoutError), Deadline(start + 1.0) as scope:
            scope.reschedule(None)
            await asyncio.sleep(5)  # stopped: its first time passes
            scope.reschedule(loop.time() + 2.0)
            await asyncio.sleep(60)
        return loop.time() - start

    assert run(main()) == pytest.approx(7.0)


def test_nested_scopes_fire_in_order_and_the_inner_one_is_reported() -> None:
    async def main() -> tuple[bool, bool]:
        loop = asyncio.get_running_loop()
        outer = Deadline(loop.time() + 10.0)
        inner = Deadline(loop.time() + 3.0)
        with outer:
            with pytest.raises(TimeoutError), inner:
                await asyncio.sleep(60)
            await asyncio.sleep(1)  # the outer one is still running
        return inner.expired(), outer.expired()

    assert run(main()) == (True, False)


def test_a_cancellation_from_outside_is_not_turned_into_a_timeout() -> None:
    async def body(started: asyncio.Event) -> None:
        with Deadline(asyncio.get_running_loop().time() + 100.0):
            started.set()
            await asyncio.sleep(60)

    async def main() -> None:
        started = asyncio.Event()
        task = asyncio.create_task(body(started))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())


def test_thousands_of_scopes_fire_each_at_its_own_time_and_dead_entries_are_compacted() -> None:
    fired: dict[int, float] = {}

    async def rollout(i: int, when: float, lives: float) -> None:
        loop = asyncio.get_running_loop()
        try:
            with Deadline(when):
                await asyncio.sleep(lives)
        except TimeoutError:
            fired[i] = loop.time()

    async def main() -> int:
        loop = asyncio.get_running_loop()
        start = loop.time()
        async with asyncio.TaskGroup() as tg:
            for i in range(5000):
                # Even ones end before their deadline, odd ones hit it.
                tg.create_task(rollout(i, start + 10 + i % 97, 5.0 if i % 2 == 0 else 500.0))
        timer = deadline_module._timers[loop]
        return len(timer._heap)

    left = run(main())
    assert sorted(fired) == list(range(1, 5000, 2))
    assert all(t == pytest.approx(10 + i % 97) for i, t in fired.items())
    assert left < 5000  # the 2,500 ended early were compacted away or popped


def test_a_deadline_fires_on_the_real_clock() -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(TimeoutError), Deadline(start + 0.05):
            await asyncio.sleep(5)
        return loop.time() - start

    assert 0.04 < asyncio.run(main()) < 1.0
