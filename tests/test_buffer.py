"""TrajectoryGroupBuffer on its own: group completion, survivors and failures, filters, order,
backpressure, the outstanding dispatches and cancellation."""

from __future__ import annotations

import asyncio

import pytest

from rllm_async.algorithms.advantages import get_advantage_fn
from rllm_async.buffer import Dispatch, TrajectoryGroupBuffer
from rllm_async.config import CoordinatorConfig
from rllm_async.coordinator import GroupState, SyncCoordinator
from rllm_async.types import Episode, Step, Trajectory
from rllm_async.vclock import run


async def _no_hook(version: int) -> None:
    return None


def setup(
    *,
    group_size: int = 2,
    min_group_size: int = 2,
    capacity: int = 4,
    filter_zero_variance: bool = True,
    filter_unsolved: bool = False,
) -> tuple[SyncCoordinator, TrajectoryGroupBuffer]:
    coord = SyncCoordinator(CoordinatorConfig(pipeline_depth=3, stall_timeout_s=60.0), 4, _no_hook)
    buffer = TrajectoryGroupBuffer(
        coord,
        group_size=group_size,
        min_group_size=min_group_size,
        advantage_fn=get_advantage_fn("grpo"),
        normalize_std=False,
        filter_zero_variance=filter_zero_variance,
        filter_unsolved=filter_unsolved,
        capacity=capacity,
    )
    return coord, buffer


def episode(
    reward: float, version: int = 0, tokens: int = 3, correct: bool | None = None
) -> Episode:
    step = Step([1], [7] * tokens, [0.0] * tokens, [version] * tokens)
    return Episode("t", [Trajectory([step], reward)], reward, is_correct=correct)


def dispatch(coord: SyncCoordinator, buffer: TrajectoryGroupBuffer, id: int) -> Dispatch:
    coord.dispatch()
    d = Dispatch(id, {"id": f"t{id}"}, f"t{id}", coord.version)
    buffer.open(d)
    return d


async def fill(
    buffer: TrajectoryGroupBuffer, dispatch_id: int, *episodes: Episode | None
) -> GroupState:
    """Add a whole group's rollouts (None: a failed one) and complete it; its new state."""
    for index, ep in enumerate(episodes):
        assert buffer.add(dispatch_id, index, ep) == (index == len(episodes) - 1)
    return (await buffer.complete(dispatch_id)).state


def test_a_group_is_queued_once_every_rollout_ended_with_advantages_in_rollout_order() -> None:
    async def main() -> None:
        coord, buffer = setup(group_size=3, min_group_size=3)
        dispatch(coord, buffer, 0)
        assert not buffer.add(0, 2, episode(1.0))
        assert not buffer.add(0, 0, episode(0.0))
        assert coord.counts.in_flight == 1 and len(buffer) == 0
        assert buffer.add(0, 1, episode(0.5)), "the group's last rollout is in"
        assert (await buffer.complete(0)).state is GroupState.BUFFERED
        assert coord.counts.buffered == 1 and len(buffer) == 1
        ready = await buffer.get()
        assert ready is not None and ready.dispatch.id == 0
        (group,) = ready.groups
        assert group.rewards == [0.0, 0.5, 1.0], "rollout order, not completion order"
        assert group.advantages == pytest.approx([-0.5, 0.0, 0.5])
        assert [e.reward for e in ready.episodes] == [0.0, 0.5, 1.0]

    run(main(), virtual=True)


def test_survivors_train_if_enough_else_the_group_fails() -> None:
    async def main() -> None:
        coord, buffer = setup(group_size=3, min_group_size=2)
        dispatch(coord, buffer, 0)
        dispatch(coord, buffer, 1)
        assert await fill(buffer, 0, episode(0.0), None, episode(1.0)) is GroupState.BUFFERED
        assert await fill(buffer, 1, None, None, episode(1.0)) is GroupState.FAILED
        assert coord.counts.failed == 1 and coord.counts.buffered == 1
        ready = await buffer.get()
        assert ready is not None and len(ready.groups[0].trajectories) == 2

    run(main(), virtual=True)


def test_zero_variance_and_unsolved_groups_are_filtered_when_asked() -> None:
    async def main() -> None:
        coord, buffer = setup()
        dispatch(coord, buffer, 0)
        assert await fill(buffer, 0, episode(1.0), episode(1.0)) is GroupState.FILTERED
        assert coord.counts.filtered == 1 and coord.outstanding == 0

        coord, buffer = setup(filter_zero_variance=False, filter_unsolved=True)
        dispatch(coord, buffer, 0)
        unsolved = episode(0.0, correct=False), episode(0.5, correct=False)
        assert await fill(buffer, 0, *unsolved) is GroupState.FILTERED
        dispatch(coord, buffer, 1)  # not judged: never counts as unsolved
        assert await fill(buffer, 1, episode(0.0), episode(0.0)) is GroupState.BUFFERED

    run(main(), virtual=True)


def test_groups_leave_oldest_policy_version_first() -> None:
    async def main() -> None:
        coord, buffer = setup()
        for i, version in enumerate([2, 0, 1]):
            dispatch(coord, buffer, i)
            await fill(buffer, i, episode(0.0, version), episode(1.0, version))
        out = [await buffer.get() for _ in range(3)]
        assert [r.min_version for r in out if r is not None] == [0, 1, 2]

    run(main(), virtual=True)


def test_a_full_queue_makes_producers_wait_and_never_evicts() -> None:
    async def main() -> None:
        coord, buffer = setup(capacity=1)
        for i in range(2):
            dispatch(coord, buffer, i)
            buffer.add(i, 0, episode(0.0))
            assert buffer.add(i, 1, episode(1.0))
        assert (await buffer.complete(0)).state is GroupState.BUFFERED
        blocked = asyncio.create_task(buffer.complete(1))
        await asyncio.sleep(5.0)
        assert not blocked.done() and len(buffer) == 1 and coord.counts.in_flight == 1
        first = await buffer.get()
        assert (await blocked).state is GroupState.BUFFERED
        second = await buffer.get()
        assert first is not None and second is not None
        assert (first.dispatch.id, second.dispatch.id) == (0, 1)

    run(main(), virtual=True)


def test_close_ends_the_queue_once_drained() -> None:
    async def main() -> None:
        coord, buffer = setup()
        dispatch(coord, buffer, 0)
        await fill(buffer, 0, episode(0.0), episode(1.0))
        buffer.close()
        assert not buffer.finished
        assert await buffer.get() is not None
        assert buffer.finished and await buffer.get() is None

    run(main(), virtual=True)


def test_outstanding_dispatches_and_cancellation() -> None:
    async def main() -> None:
        coord, buffer = setup()
        for i in range(4):
            dispatch(coord, buffer, i)
        await fill(buffer, 0, episode(0.0, tokens=3), episode(1.0, tokens=3))  # handed out below
        await fill(buffer, 1, episode(0.0, tokens=3), episode(1.0, tokens=4))  # queued
        await fill(buffer, 2, episode(0.0, tokens=3), episode(0.0, tokens=3))  # filtered
        buffer.add(3, 0, episode(1.0, tokens=5))  # one rollout of two in
        assert [d.id for d in buffer.outstanding()] == [0, 1, 3]
        handed = await buffer.get()
        assert handed is not None and handed.dispatch.id == 0
        coord.move(GroupState.BUFFERED, GroupState.CONSUMED)
        assert [d.id for d in buffer.outstanding()] == [1, 3]
        assert buffer.cancel() == 3 + 4 + 5, "the queued group's tokens and the partial one's"
        assert len(buffer) == 0 and coord.outstanding == 0
        assert coord.counts.cancelled == 2 and coord.counts.conserved()
        # What was cancelled stays outstanding: a checkpoint runs those tasks again.
        assert [d.task["id"] for d in buffer.outstanding()] == ["t1", "t3"]

    run(main(), virtual=True)


def test_cancel_counts_the_tokens_of_a_group_waiting_for_room() -> None:
    async def main() -> None:
        coord, buffer = setup(capacity=1)
        for i in range(2):
            dispatch(coord, buffer, i)
        await fill(buffer, 0, episode(0.0, tokens=3), episode(1.0, tokens=3))
        blocked = asyncio.create_task(fill(buffer, 1, episode(0.0, tokens=7), episode(1.0)))
        await asyncio.sleep(1.0)
        assert not blocked.done()
        assert buffer.cancel() == 3 + 3 + 7 + 3
        blocked.cancel()

    run(main(), virtual=True)
