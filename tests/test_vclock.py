"""The virtual-clock event loop: timers jump instead of sleeping, threads still wake it."""

from __future__ import annotations

import asyncio
import selectors
import threading
import time

import pytest

from rllm_async import vclock


def test_sleep_advances_virtual_time_exactly() -> None:
    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        seen = [loop.time()]
        await asyncio.sleep(3600)
        seen.append(loop.time())
        await asyncio.sleep(0.25)
        seen.append(loop.time())
        await asyncio.sleep(0)
        seen.append(loop.time())
        return seen

    assert vclock.run(main(), virtual=True) == [0.0, 3600.0, 3600.25, 3600.25]


def test_timers_fire_in_deadline_order_at_their_deadlines() -> None:
    async def main() -> list[tuple[str, float]]:
        loop = asyncio.get_running_loop()
        fired: list[tuple[str, float]] = []

        async def sleeper(name: str, delay: float) -> None:
            await asyncio.sleep(delay)
            fired.append((name, loop.time()))

        loop.call_later(1.5, lambda: fired.append(("callback", loop.time())))
        await asyncio.gather(sleeper("c", 3.0), sleeper("a", 1.0), sleeper("b", 2.0))
        return fired

    assert vclock.run(main(), virtual=True) == [
        ("a", 1.0),
        ("callback", 1.5),
        ("b", 2.0),
        ("c", 3.0),
    ]


def test_long_virtual_sleep_takes_little_wall_time(monkeypatch) -> None:
    waits: list[float | None] = []  # the timeout of every real select

    class Selector(selectors.DefaultSelector):
        def select(self, timeout: float | None = None) -> list:
            waits.append(timeout)
            return super().select(timeout)

    monkeypatch.setattr(vclock.selectors, "DefaultSelector", Selector)

    async def main() -> float:
        await asyncio.sleep(30 * 24 * 3600)  # longer than asyncio's one-day select cap
        return asyncio.get_running_loop().time()

    assert vclock.run(main(), virtual=True) == 30 * 24 * 3600
    assert len(waits) >= 30 and set(waits) == {0}  # it polled, never waited in real time


def test_timeouts_fire_at_virtual_deadlines() -> None:
    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        seen = []
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(5):
                await asyncio.sleep(10)
        seen.append(loop.time())
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.sleep(10), 2.5)
        seen.append(loop.time())
        assert await asyncio.wait_for(asyncio.sleep(1, result="ok"), 2) == "ok"
        seen.append(loop.time())
        return seen

    assert vclock.run(main(), virtual=True) == [5.0, 7.5, 8.5]


def test_call_soon_threadsafe_wakes_an_idle_loop() -> None:
    async def main() -> tuple[int, float]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[int] = loop.create_future()

        def worker() -> None:
            time.sleep(0.05)
            loop.call_soon_threadsafe(fut.set_result, 7)

        threading.Thread(target=worker).start()
        return await fut, loop.time()

    assert vclock.run(main(), virtual=True) == (7, 0.0)


def test_clock_follows_real_time_while_executor_work_runs() -> None:
    async def main() -> tuple[bool, float]:
        loop = asyncio.get_running_loop()
        pending = asyncio.create_task(asyncio.sleep(1000))
        await asyncio.to_thread(time.sleep, 0.05)
        skipped_ahead = pending.done()
        pending.cancel()
        return skipped_ahead, loop.time()

    skipped_ahead, now = vclock.run(main(), virtual=True)
    assert not skipped_ahead
    assert 0.04 <= now < 10.0


def test_run_cancels_leftover_tasks_and_closes_the_loop() -> None:
    state: dict[str, object] = {}

    async def forever() -> None:
        try:
            await asyncio.sleep(1e9)
        except asyncio.CancelledError:
            state["cancelled"] = True
            raise

    async def main() -> str:
        state["task"] = asyncio.create_task(forever())
        state["loop"] = asyncio.get_running_loop()
        await asyncio.sleep(0)
        return "done"

    assert vclock.run(main(), virtual=True) == "done"
    assert state["cancelled"] is True
    loop = state["loop"]
    assert isinstance(loop, vclock.VirtualClockLoop)
    assert loop.is_closed()


def test_run_without_virtual_clock_uses_real_time() -> None:
    async def main() -> bool:
        loop = asyncio.get_running_loop()
        start = loop.time()
        await asyncio.sleep(0.01)
        return not isinstance(loop, vclock.VirtualClockLoop) and loop.time() - start >= 0.01

    assert vclock.run(main(), virtual=False)
