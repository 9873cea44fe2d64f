"""A workflow that spawns a subagent and forks itself trains end to end on the tiny model: each
rollout's branches reach the learner, grouped by role."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rllm_async import UnifiedTrainer
from rllm_async.config import config_from_dict
from rllm_async.rollout import RolloutContext
from rllm_async.types import Episode, TrajectoryGroup
from rllm_async.workflows.base import Workflow
from tests.digits import digit_fraction


class Planner(Workflow):
    """The root replies, a `helper` subagent replies to it, and a fork of the root replies again;
    the episode's reward is the share of digits in the helper's reply."""

    async def run(self, task: dict[str, Any], ctx: RolloutContext) -> Episode:
        chat = [{"role": "user", "content": task["prompt"]}]
        plan = await ctx.chat(chat)
        helper = ctx.spawn("helper")
        answer = await helper.chat([{"role": "user", "content": plan["content"] or "?"}])
        await ctx.fork().chat([*chat, plan, {"role": "user", "content": "again"}])
        return ctx.build_episode(digit_fraction(task, answer["content"] or ""))


def test_a_tree_workflow_trains_every_branch_grouped_by_role(tmp_path: Path) -> None:
    seen: list[TrajectoryGroup] = []
    config = config_from_dict(
        {
            "name": "tree",
            "run_dir": str(tmp_path),
            "seed": 0,
            "mode": "sync",
            "backend": {"name": "local", "model": "tiny", "max_seq_len": 64},
            "rollout": {"group_size": 4, "max_tokens": 6},
            "train": {"total_steps": 3, "groups_per_step": 2},
            "algorithm": {"filter_zero_variance": False},
            "checkpoint": {"resume": "never", "at_end": False},
            "logging": {"progress_bar": False},
        }
    )
    tasks = [{"id": str(i), "prompt": f"n={i}"} for i in range(20)]
    trainer = UnifiedTrainer(config, workflow=Planner(), train_tasks=tasks)
    backend = trainer.backend
    forward_backward = backend.forward_backward

    async def spy(groups: list[TrajectoryGroup], loss: Any) -> dict[str, float]:
        seen.extend(groups)
        return await forward_backward(groups, loss)

    backend.forward_backward = spy  # type: ignore[method-assign]
    records = trainer.run()
    assert len([r for r in records if "rollout/reward/mean" in r]) == 3
    # Two groups per dispatch: the root and its fork (role `default`), and the helpers.
    assert sorted({g.name for g in seen}) == ["default", "helper"]
    for g in seen:
        per_rollout = 2 if g.name == "default" else 1
        assert len(g.trajectories) == 4 * per_rollout == len(g.advantages)
        for t in g.trajectories:
            assert (t.parent is None) == (t.node is None)
            if g.name == "helper":
                assert t.parent is not None and t.parent.kind == "spawn" and t.parent.step == 0
