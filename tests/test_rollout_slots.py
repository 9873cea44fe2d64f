"""RolloutSlots: the limit shrinks while a rollout is late and grows back; property tests that no
waiting rollout starves, and that the trainer keeps the hard bound with the limit binding."""

from __future__ import annotations

import asyncio

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rllm_async.config import CoordinatorConfig
from rllm_async.coordinator import SyncCoordinator
from rllm_async.plan.simulate import run_workload
from rllm_async.rollout_slots import RolloutSlots
from rllm_async.vclock import run
from tests import heavy_tailed


async def _no_hook(version: int) -> None:
    return None


def _coordinator(max_staleness: int | None) -> SyncCoordinator:
    config = CoordinatorConfig(pipeline_depth=0, max_staleness=max_staleness)
    return SyncCoordinator(config, groups_per_step=1, on_policy_updated=_no_hook)


def test_generation_is_idle_while_no_slot_is_held_or_model_calls_are_paused() -> None:
    async def scenario() -> None:
        coord = SyncCoordinator(CoordinatorConfig(), 1, lambda version: asyncio.sleep(2.0))
        slots = RolloutSlots(4, None, coord)
        sleep = asyncio.sleep
        await sleep(1.0)  # before the first rollout: not counted
        first = await slots.acquire()
        second = await slots.acquire()
        await sleep(1.0)
        slots.release(first)
        await sleep(1.0)  # one still runs
        await coord.update_policy(1)  # 2 s paused
        assert coord.rollouts_running and coord.take_generation_idle() == 2.0
        slots.release(second)
        await sleep(3.0)
        assert not coord.rollouts_running
        await slots.acquire()
        await sleep(1.0)
        assert coord.take_generation_idle() == 3.0

    run(scenario(), virtual=True)


def test_the_limit_shrinks_while_a_rollout_is_staler_than_half_the_bound() -> None:
    async def scenario() -> None:
        coord = _coordinator(max_staleness=8)
        slots = RolloutSlots(4, 0.5, coord)
        old = await slots.acquire()
        await coord.update_policy(4)
        assert slots.limit() == 4, "staleness 4 is not more than 8 // 2"
        await coord.update_policy(5)
        assert slots.limit() == 2
        young = await slots.acquire()
        assert young == 5 and slots.running == 2
        waiting = [asyncio.create_task(slots.acquire()) for _ in range(3)]
        await asyncio.sleep(0)
        assert slots.running == 2 and not any(t.done() for t in waiting)
        slots.release(young)  # the late rollout still runs: only one more may start
        await asyncio.sleep(0)
        assert [t.done() for t in waiting] == [True, False, False]
        slots.release(old)  # none is late now: the full limit again
        await asyncio.sleep(0)
        assert all(t.done() for t in waiting) and slots.running == 3

    run(scenario(), virtual=True)


def test_without_a_bound_or_a_share_the_limit_is_fixed() -> None:
    async def scenario() -> None:
        for k, share in ((None, 0.5), (2, None)):
            coord = _coordinator(max_staleness=k)
            slots = RolloutSlots(3, share, coord)
            await slots.acquire()
            await coord.update_policy(10)
            assert slots.limit() == 3
            assert [await slots.acquire() for _ in range(2)] == [10, 10]

    run(scenario(), virtual=True)


def test_a_cancelled_waiter_gives_its_slot_back() -> None:
    async def scenario() -> None:
        slots = RolloutSlots(1, 0.5, _coordinator(max_staleness=2))
        first = await slots.acquire()
        waiter = asyncio.create_task(slots.acquire())
        await asyncio.sleep(0)
        slots.release(first)  # grants the waiter, which is cancelled before it resumes
        waiter.cancel()
        await asyncio.sleep(0)
        assert slots.running == 0
        assert await slots.acquire() == 0

    run(scenario(), virtual=True)


def test_a_freed_slot_goes_to_the_rollout_that_waited_for_it_not_to_a_newcomer() -> None:
    async def scenario() -> None:
        slots = RolloutSlots(2, None, _coordinator(max_staleness=None))
        first = await slots.acquire()
        await slots.acquire()
        assert slots.running == 2
        waiter = asyncio.create_task(slots.acquire())
        await asyncio.sleep(0)
        assert not waiter.done(), "the limit is reached"
        slots.release(first)  # the freed slot goes to the waiter, before it resumes
        newcomer = asyncio.create_task(slots.acquire())
        await asyncio.sleep(0)
        assert waiter.done() and not newcomer.done() and slots.running == 2
        slots.release(await waiter)
        assert await newcomer == 0, "free again"

    run(scenario(), virtual=True)


@st.composite
def workloads(draw: st.DrawFn) -> dict:
    n = draw(st.integers(1, 60))
    return {
        "k": draw(st.integers(0, 6)),
        "max_concurrency": draw(st.integers(1, 12)),
        "share": draw(st.sampled_from([None, 0.1, 0.5, 0.9, 1.0])),
        "arrivals": draw(st.lists(st.floats(0.0, 20.0), min_size=n, max_size=n)),
        "durations": draw(st.lists(st.floats(0.01, 10.0), min_size=n, max_size=n)),
        "step_s": draw(st.floats(0.5, 5.0)),
    }


class CheckedSlots(RolloutSlots):
    """RolloutSlots that checks, at each grant, that it is within the limit of that moment."""

    def _grant(self) -> int:
        assert self.running < self.limit()
        return super()._grant()


@settings(max_examples=60, deadline=None)
@given(w=workloads())
def test_grants_in_order_within_the_limit_and_never_starve(w: dict) -> None:
    """Whatever the versions do, rollouts start first come first served, never above the limit
    as it stands, and each waits at most (rollouts ahead of it + 1) times the longest rollout."""
    longest = max(w["durations"])
    started: dict[int, float] = {}
    waits: list[tuple[float, int]] = []

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        coord = _coordinator(max_staleness=w["k"])
        slots = CheckedSlots(w["max_concurrency"], w["share"], coord)
        queued: list[int] = []

        async def rollout(i: int) -> None:
            await asyncio.sleep(w["arrivals"][i])
            ahead = len(queued) - len(started)  # arrived before it, not started yet
            queued.append(i)
            arrived = loop.time()
            start = await slots.acquire()
            # On the virtual clock a grant and the resumption it wakes share one instant.
            started[i] = loop.time()
            waits.append((loop.time() - arrived, ahead))
            await asyncio.sleep(w["durations"][i])
            slots.release(start)

        async def trainer() -> None:
            version = 0
            while len(started) < len(w["arrivals"]) or slots.running:
                await asyncio.sleep(w["step_s"])
                version += 1
                await coord.update_policy(version)

        async with asyncio.TaskGroup() as group:
            group.create_task(trainer())
            for i in range(len(w["arrivals"])):
                group.create_task(rollout(i))
        assert slots.running == 0
        # First come, first served: none starts before one that queued ahead of it (rollouts
        # granted in one instant may resume in any order).
        times = [started[i] for i in queued]
        assert times == sorted(times)

    run(scenario(), virtual=True)
    assert len(started) == len(w["arrivals"])
    for waited, ahead in waits:
        assert waited <= (ahead + 1) * longest + 1e-6


@st.composite
def schedules(draw: st.DrawFn) -> dict:
    return {
        **draw(heavy_tailed.schedules()),
        "max_concurrency": draw(st.integers(1, 8)),
        "share": draw(st.sampled_from([None, 0.25, 0.5, 1.0])),
    }


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(s=schedules())
def test_the_trainer_keeps_the_hard_bound_with_the_late_limit(tmp_path, s: dict) -> None:
    """Heavy-tailed rollouts under a binding concurrency limit: every step trains, no trained
    group is staler than K, and the run ends (no rollout waits for ever)."""
    rollout = {"max_concurrency": s["max_concurrency"], "late_concurrency": s["share"]}
    trainer, backend = heavy_tailed.trainer(tmp_path, s, rollout, {})
    records = run(trainer.fit(), virtual=True)

    assert len(records) == 6
    assert all(len(step) == s["gps"] for step in backend.trained)
    assert backend.staleness and max(backend.staleness) <= s["k"]
    assert backend.policy().live == {}, "every pinned snapshot is released"


def test_on_w1_the_late_limit_drops_fewer_groups_and_finishes_sooner() -> None:
    """The sim's W1 under K=8, d=4 from the default 512 slots: late rollouts finish in time."""
    common = [
        "mode=async",
        "coordinator.pipeline_depth=4",
        "coordinator.max_staleness=8",
        "train.total_steps=20",
    ]
    fixed = run_workload("W1", [*common, "rollout.late_concurrency=null"])
    late = run_workload("W1", common)
    assert fixed["violations"] == late["violations"] == 0
    assert late["dropped_stale"] < fixed["dropped_stale"] / 2
    assert late["waste_steady"] < fixed["waste_steady"] / 2
    assert late["time_s"] < fixed["time_s"]
