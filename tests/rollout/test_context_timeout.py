"""`RolloutContext.timeout`: a scope that fires a margin before the rollout's deadline and is moved
by the time a model call waits for a weight sync."""

from __future__ import annotations

import asyncio

import pytest

from rllm_async.protocols import SamplingParams
from rllm_async.rollout import RolloutContext, SyncPause
from rllm_async.vclock import run
from tests.fakes import FakePolicy


def _context(deadline: float, pause: SyncPause) -> RolloutContext:
    return RolloutContext(
        FakePolicy(),
        sampling=SamplingParams(),
        pin=False,
        pause=pause,
        deadline=deadline,
        task_id="t",
    )


async def _sync_of_5_s(pause: SyncPause) -> None:
    """A weight sync that holds `pause` for 5 s."""
    pause.pause()
    await asyncio.sleep(5.0)
    pause.resume()


def test_the_scope_fires_its_margin_before_the_deadline() -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        start = loop.time()
        ctx = _context(start + 10.0, SyncPause())
        with pytest.raises(TimeoutError):
            async with ctx.timeout(2.0):
                await asyncio.sleep(60)
        return loop.time() - start

    assert run(main(), virtual=True) == pytest.approx(8.0)


def test_a_wait_for_a_weight_sync_moves_the_scope_by_the_wait() -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        start = loop.time()
        pause = SyncPause()
        ctx = _context(start + 10.0, pause)
        sync = asyncio.create_task(_sync_of_5_s(pause))
        with pytest.raises(TimeoutError):
            async with ctx.timeout(2.0):
                await asyncio.sleep(0)  # the sync starts
                await ctx.generate([1, 2, 3], max_tokens=1)  # waits out the sync: 5 s not charged
                await asyncio.sleep(60)
        await sync
        return loop.time() - start

    assert run(main(), virtual=True) == pytest.approx(13.0)


def test_a_scope_entered_after_a_sync_wait_starts_from_the_moved_deadline() -> None:
    # A 10 s deadline, a sync of 5 s waited out, then a scope: it fires 2 s before 15 s.
    async def main() -> float:
        loop = asyncio.get_running_loop()
        start = loop.time()
        pause = SyncPause()
        ctx = _context(start + 10.0, pause)
        sync = asyncio.create_task(_sync_of_5_s(pause))
        await asyncio.sleep(0)
        await ctx.generate([1, 2, 3], max_tokens=1)
        await sync
        with pytest.raises(TimeoutError):
            async with ctx.timeout(2.0):
                await asyncio.sleep(60)
        return loop.time() - start

    assert run(main(), virtual=True) == pytest.approx(13.0)
