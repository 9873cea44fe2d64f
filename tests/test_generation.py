"""The generation loop on its own: a group of rollouts per admitted task, every episode into the
buffer, the per-rollout accounting in the step record, and the concurrency limit."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from rllm_async.accounting import Accounting
from rllm_async.algorithms.advantages import get_advantage_fn
from rllm_async.buffer import TrajectoryGroupBuffer
from rllm_async.config import Config
from rllm_async.coordinator import GroupState, SyncCoordinator
from rllm_async.data import TaskSource
from rllm_async.generation import Generation
from rllm_async.metrics import MetricsAggregator
from rllm_async.plan.record import WorkloadRecorder
from rllm_async.rollout import RolloutContext
from rllm_async.step_record import StepRecord
from rllm_async.types import Episode
from rllm_async.vclock import run
from rllm_async.workflows.base import Workflow
from tests.fakes import FakePolicy, ScriptedWorkflow, make_config, tasks


async def _no_hook(version: int) -> None:
    return None


def _generate(
    config: Config, workflow: Workflow, n_tasks: int
) -> tuple[dict[str, float], SyncCoordinator, list[str]]:
    """Run generation over `n_tasks` tasks, consuming every group it buffers; the record of it
    all, the coordinator, and the consumed groups' task ids."""

    async def main() -> tuple[dict[str, float], SyncCoordinator, list[str]]:
        coord = SyncCoordinator(config.coordinator, config.train.groups_per_step, _no_hook)
        buffer = TrajectoryGroupBuffer.from_config(config, coord, get_advantage_fn("grpo"))
        source = TaskSource.from_config(config, tasks(n_tasks))
        loop = asyncio.get_running_loop()
        now = loop.time()
        record = StepRecord(MetricsAggregator(), coord.snapshot(), now)
        workload = WorkloadRecorder({}, clock=loop.time, start=now)
        accounting = Accounting(config, record, workload, source, workflow.metric_reductions)
        limit = config.rollout.max_concurrency
        assert limit != "auto"
        policy = FakePolicy()
        generation = Generation(config, workflow, policy, coord, buffer, source, accounting, limit)
        consumed = []
        async with asyncio.TaskGroup() as scope:
            scope.create_task(generation.run())
            while (ready := await buffer.get()) is not None:
                coord.move(GroupState.BUFFERED, GroupState.CONSUMED)
                consumed.append(ready.dispatch.task_id)
        record.group_counts(coord.snapshot())
        return record.flush(1), coord, consumed

    return run(main(), virtual=True)


def _config(tmp_path: Path, **rollout: Any) -> Config:
    return make_config(
        tmp_path,
        rollout={"group_size": 4, "retries": 0, **rollout},
        train={"total_epochs": 1},
        algorithm={"filter_zero_variance": False},
    )


def test_each_admitted_task_runs_one_group_into_the_buffer(tmp_path: Path) -> None:
    workflow = ScriptedWorkflow()  # rewards 0, 1, 0, 1 by rollout index
    out, coord, consumed = _generate(_config(tmp_path), workflow, 3)
    assert sorted(consumed) == ["t0", "t1", "t2"], "every task once, one epoch"
    assert workflow.started == 12, "group_size rollouts each"
    assert coord.counts.dispatched == 3 and coord.counts.consumed == 3
    assert out["groups/dispatched"] == 3 and out["groups/consumed"] == 3
    assert out["tokens/generated"] == 12 * 3, "the fake policy answers three tokens"
    assert out["rollout/reward/mean"] == 0.5
    assert "rollout/failures" not in out and "tokens/wasted" not in out


def test_a_group_with_too_few_rollouts_fails_and_its_tokens_are_wasted(tmp_path: Path) -> None:
    workflow = ScriptedWorkflow(
        fault=lambda task, i, a: "raise" if task["id"] == "t1" and i == 0 else None
    )
    out, coord, consumed = _generate(_config(tmp_path, min_group_size=4), workflow, 3)
    assert sorted(consumed) == ["t0", "t2"]
    assert coord.counts.failed == 1 and out["groups/failed"] == 1
    assert out["rollout/failures"] == 1
    assert out["tokens/wasted"] == 3 * 3, "its three finished rollouts' tokens"


def test_groups_judged_all_right_or_all_wrong_are_counted(tmp_path: Path) -> None:
    class Judged(Workflow):
        """Every rollout of t0 right, of the others wrong."""

        async def run(self, task: dict[str, Any], ctx: RolloutContext) -> Episode:
            await ctx.generate([1, 2, 3])
            right = task["id"] == "t0"
            return Episode(task["id"], [], float(right), is_correct=right)

    out, _, _ = _generate(_config(tmp_path), Judged(), 3)
    assert out["groups/solve_all"] == 1, "t0: every rollout right"
    assert out["groups/solve_none"] == 2, "t1 and t2: none right"


def test_no_more_rollouts_run_at_once_than_max_concurrency(tmp_path: Path) -> None:
    class Counting(Workflow):
        def __init__(self) -> None:
            self.running = self.most = self.done = 0

        async def run(self, task: dict[str, Any], ctx: RolloutContext) -> float:
            self.running += 1
            self.most = max(self.most, self.running)
            await asyncio.sleep(1.0)
            await ctx.generate([1, 2, 3])
            self.running -= 1
            self.done += 1
            return 1.0

    workflow = Counting()
    _generate(_config(tmp_path, max_concurrency=3), workflow, 3)
    assert workflow.done == 12 and workflow.most == 3
