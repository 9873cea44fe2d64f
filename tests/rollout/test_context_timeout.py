"""`RolloutContext.timeout`: a scope that fires a margin before the rollout's deadline, entered with
`with` or `async with`, and moved by the time a model call waits for a weight sync."""

from __future__ import annotations

import asyncio

import pytest

from rllm_async.protocols import SamplingParams
from rllm_async.rollout import RolloutContext
from rllm_async.vclock import run
from tests.fakes import FakePolicy


def _context(deadline: float, wait_unpaused) -> RolloutContext:
    return RolloutContext(
        FakePolicy(),
        sampling=SamplingParams(),
        pin=False,
        wait_unpaused=wait_unpaused,
        deadline=deadline,
        task_id="t",
    )


async def _open() -> None:
    return None


async def _sync_of_5_s() -> None:
    await asyncio.sleep(5.0)


@pytest.mark.parametrize("entered", ["with", "async with"])
def test_the_scope_fires_its_margin_before_the_deadline(entered: str) -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        start = loop.time()
        ctx = _context(start + 10.0, _open)
        with pytest.raises(TimeoutError):
            if entered == "with":
                with ctx.timeout(2.0):
                    await asyncio.sleep(60)
            else:
                async with ctx.timeout(2.0):
                    await asyncio.sleep(60)
        return loop.time() - start

    assert run(main(), virtual=True) == pytest.approx(8.0)


def test_a_wait_for_a_weight_sync_moves_the_scope_by_the_wait() -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        start = loop.time()

        ctx = _context(start + 10.0, _sync_of_5_s)
        with pytest.raises(TimeoutError), ctx.timeout(2.0):
            await ctx.generate([1, 2, 3], max_tokens=1)  # waits out the sync: 5 s not charged
            await asyncio.sleep(60)
        return loop.time() - start

    assert run(main(), virtual=True) == pytest.approx(13.0)


def test_a_scope_made_before_a_sync_wait_and_entered_after_moves_with_it() -> None:
    # Made at 0 with a 10 s deadline, then a sync of 5 s, then entered: it fires 2 s before 15 s.
    async def main() -> float:
        loop = asyncio.get_running_loop()
        start = loop.time()

        ctx = _context(start + 10.0, _sync_of_5_s)
        scope = ctx.timeout(2.0)
        await ctx.generate([1, 2, 3], max_tokens=1)
        with pytest.raises(TimeoutError), scope:
            await asyncio.sleep(60)
        return loop.time() - start

    assert run(main(), virtual=True) == pytest.approx(13.0)
