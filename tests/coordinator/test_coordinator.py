"""SyncCoordinator on its own: admission, group moves and conservation, the staleness bound,
restore, the weight sync as a transaction, and stall detection."""

from __future__ import annotations

import asyncio

import pytest

from rllm_async.config import CoordinatorConfig
from rllm_async.coordinator import GroupState, StallError, SyncCoordinator, SyncTimeoutError
from rllm_async.vclock import run


async def _no_hook(version: int) -> None:
    return None


def coordinator(groups_per_step: int = 2, hook=_no_hook, **cfg) -> SyncCoordinator:
    return SyncCoordinator(CoordinatorConfig(**cfg), groups_per_step, hook)


def test_admission_allows_depth_plus_one_steps_of_groups() -> None:
    async def main() -> None:
        coord = coordinator(groups_per_step=2, pipeline_depth=1)
        for _ in range(4):  # (version 0 + d 1 + 1) * 2
            assert coord.can_admit()
            coord.dispatch()
        assert not coord.can_admit()
        with pytest.raises(RuntimeError, match="without admission"):
            coord.dispatch()
        # A consumed group keeps its slot until the version moves on.
        coord.move(GroupState.IN_FLIGHT, GroupState.BUFFERED)
        coord.move(GroupState.BUFFERED, GroupState.CONSUMED)
        assert not coord.can_admit()
        await coord.update_policy(1)
        assert coord.can_admit()

    run(main(), virtual=True)


@pytest.mark.parametrize("ended", [GroupState.FILTERED, GroupState.FAILED])
def test_filtered_and_failed_groups_free_their_slot_at_once(ended) -> None:
    coord = coordinator(groups_per_step=1, pipeline_depth=0)
    coord.dispatch()
    assert not coord.can_admit()
    coord.move(GroupState.IN_FLIGHT, ended)
    assert coord.can_admit()


def test_sync_warmup_steps_run_on_policy() -> None:
    async def main() -> None:
        coord = coordinator(groups_per_step=1, pipeline_depth=2, sync_warmup_steps=1)
        assert coord.pipeline_depth == 0
        await coord.update_policy(1)
        assert coord.pipeline_depth == 2

    run(main(), virtual=True)


def test_moves_keep_conservation_and_refuse_illegal_transitions() -> None:
    coord = coordinator(groups_per_step=4, pipeline_depth=0)
    events: list[str] = []
    coord.on_event = lambda name, counts: events.append(name)
    for _ in range(4):
        coord.dispatch()
    coord.move(GroupState.IN_FLIGHT, GroupState.BUFFERED)
    coord.move(GroupState.BUFFERED, GroupState.DROPPED_STALE, requeued=True)
    coord.move(GroupState.IN_FLIGHT, GroupState.CANCELLED)
    with pytest.raises(RuntimeError, match="illegal group transition consumed -> buffered"):
        coord.move(GroupState.CONSUMED, GroupState.BUFFERED)
    with pytest.raises(RuntimeError, match="no group is buffered"):
        coord.move(GroupState.BUFFERED, GroupState.CONSUMED)
    snap = coord.snapshot()
    assert snap["dispatched"] == 4 and snap["in_flight"] == 2 and snap["requeued"] == 1
    assert snap["dropped_stale"] == snap["cancelled"] == 1 and coord.outstanding == 2
    assert coord.counts.conserved()
    assert events == ["dispatched"] * 4 + ["buffered", "dropped_stale", "cancelled"]


def test_the_hard_staleness_bound() -> None:
    async def main() -> None:
        bounded = coordinator(max_staleness=1)
        unbounded = coordinator(max_staleness=None)
        for version in (1, 2, 3):
            await bounded.update_policy(version)
            await unbounded.update_policy(version)
        assert bounded.staleness(1) == 2
        assert not bounded.too_stale(2) and bounded.too_stale(1)
        assert not unbounded.too_stale(0)

    run(main(), virtual=True)


def test_restore_counts_the_groups_consumed_before_the_checkpoint() -> None:
    coord = coordinator(groups_per_step=2, pipeline_depth=0)
    coord.restore(3)
    assert coord.version == 3
    assert coord.counts.dispatched == coord.counts.consumed == 6
    assert coord.counts.conserved() and coord.outstanding == 0
    # Admission continues where the original run was: one step's worth of groups.
    coord.dispatch()
    coord.dispatch()
    assert not coord.can_admit()


def test_a_weight_sync_pauses_new_model_calls_until_it_ends() -> None:
    async def main() -> None:
        seen: list[tuple[str, bool]] = []
        coord: SyncCoordinator

        async def hook(version: int) -> None:
            seen.append(("hook", coord.pause.paused))
            await asyncio.sleep(5.0)

        coord = coordinator(hook=hook)

        async def model_call() -> float:
            await asyncio.sleep(1.0)
            await coord.pause.wait()
            return asyncio.get_running_loop().time()

        call = asyncio.create_task(model_call())
        hook_s, total_s = await coord.update_policy(1)
        assert seen == [("hook", True)] and not coord.pause.paused and coord.version == 1
        assert hook_s == pytest.approx(5.0) and total_s == pytest.approx(5.0)
        assert await call == pytest.approx(5.0), "the call waited for the sync to end"

    run(main(), virtual=True)


def test_one_coordinator_pauses_model_calls_on_one_event_loop_after_another() -> None:
    """A trainer fitted twice runs each fit on a fresh loop; its pause serves both."""

    async def hook(version: int) -> None:
        await asyncio.sleep(5.0)

    coord = coordinator(hook=hook)

    async def sync_with_a_call_waiting(version: int) -> float:
        loop = asyncio.get_running_loop()
        start = loop.time()

        async def model_call() -> float:
            await asyncio.sleep(1.0)
            await coord.pause.wait()
            return loop.time() - start

        call = asyncio.create_task(model_call())
        await coord.update_policy(version)
        return await call

    assert run(sync_with_a_call_waiting(1), virtual=True) == pytest.approx(5.0)
    assert run(sync_with_a_call_waiting(2), virtual=True) == pytest.approx(5.0)


def test_a_sync_past_its_timeout_fails_and_generation_resumes() -> None:
    async def main() -> None:
        async def hang(version: int) -> None:
            await asyncio.Event().wait()

        coord = coordinator(hook=hang, sync_timeout_s=10.0)
        with pytest.raises(SyncTimeoutError, match=r"sync_timeout_s=10\.0"):
            await coord.update_policy(1)
        assert not coord.pause.paused and coord.version == 0

    run(main(), virtual=True)


def test_a_failing_sync_is_retried() -> None:
    async def main() -> None:
        calls: list[int] = []

        async def flaky(version: int) -> None:
            calls.append(version)
            if len(calls) == 1:
                raise ConnectionError("first try fails")

        coord = coordinator(hook=flaky, sync_retries=1)
        await coord.update_policy(1)
        assert calls == [1, 1] and coord.version == 1

        calls.clear()
        never = coordinator(hook=flaky, sync_retries=0)
        with pytest.raises(ConnectionError):
            await never.update_policy(1)
        assert not never.pause.paused and never.version == 0

    run(main(), virtual=True)


def test_a_wait_with_no_progress_stalls_with_the_counts() -> None:
    async def main() -> None:
        coord = coordinator(groups_per_step=1, pipeline_depth=0, stall_timeout_s=30.0)
        coord.dispatch()
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(StallError, match=r"waiting for admission.*'in_flight': 1"):
            await coord.wait_admissible()
        assert asyncio.get_running_loop().time() - t0 == pytest.approx(30.0)

    run(main(), virtual=True)


def test_waiters_wake_on_the_event_that_satisfies_them() -> None:
    async def main() -> None:
        coord = coordinator(groups_per_step=1, pipeline_depth=0)
        coord.dispatch()
        waiter = asyncio.create_task(coord.wait_admissible())
        await asyncio.sleep(1.0)
        assert not waiter.done()
        coord.move(GroupState.IN_FLIGHT, GroupState.FILTERED)
        await asyncio.wait_for(waiter, timeout=0.001)

    run(main(), virtual=True)
