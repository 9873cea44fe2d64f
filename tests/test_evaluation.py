"""Evaluation on its own: the Evaluator's `eval/*` metrics on one pinned version, when EvalSchedule
runs evaluations beside training, and scoring a saved checkpoint."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from rllm_async import checkpoint
from rllm_async.callbacks import Callback
from rllm_async.checkpoint import CheckpointState
from rllm_async.config import Config
from rllm_async.evaluation import EvalSchedule, Evaluator, evaluate_checkpoint
from rllm_async.rollout import RolloutContext, SyncPause
from rllm_async.types import Episode
from rllm_async.vclock import run
from rllm_async.workflows.base import Workflow
from tests.fakes import FakeBackend, FakePolicy, ScriptedWorkflow, make_config, tasks


class Judged(Workflow):
    """Right on the tasks whose ids `right` names; each episode reports one `calls`."""

    def __init__(self, right: tuple[str, ...] = ("t0", "t1")) -> None:
        self.right = right

    async def run(self, task: dict[str, Any], ctx: RolloutContext) -> Episode:
        await ctx.generate([1, 2, 3])
        correct = task["id"] in self.right
        return Episode(task["id"], [], float(correct), correct, metrics={"calls": 1})


class Heard(Callback):
    def __init__(self) -> None:
        self.evals: list[tuple[int, dict[str, float]]] = []

    def on_eval_end(self, step: int, metrics: dict[str, float]) -> None:
        self.evals.append((step, metrics))


def _config(tmp_path: Path, **eval_keys: Any) -> Config:
    return make_config(tmp_path, train={"total_steps": 5}, eval={"every_steps": 1, **eval_keys})


def test_every_task_is_scored_once_on_one_pinned_version(tmp_path: Path) -> None:
    policy, heard = FakePolicy(), Heard()
    policy.version = 2
    evaluator = Evaluator(_config(tmp_path), Judged(), tasks(5), [heard], 256)
    out = run(evaluator.evaluate(policy, SyncPause()), virtual=True)
    assert out["eval/policy_version"] == 2 and out["eval/n"] == 5 and out["eval/failed"] == 0
    assert out["eval/reward/mean"] == 0.4 and out["eval/accuracy"] == 0.4
    assert out["eval/episode/calls"] == 1.0
    assert out["eval/time_s"] >= 0.0
    assert policy.calls == 5 and policy.live == {}, "one call per task, the pin released"
    assert policy.priorities == [0] * 5
    assert heard.evals == [(2, out)]


def test_failed_rollouts_are_counted_and_left_out_of_the_means(tmp_path: Path) -> None:
    failing = ScriptedWorkflow(
        reward=lambda task, i, a: 1.0,
        fault=lambda task, i, a: "raise" if task["id"] == "t1" else None,
    )
    evaluator = Evaluator(_config(tmp_path), failing, tasks(4), [], 256)
    out = run(evaluator.evaluate(FakePolicy(), SyncPause()), virtual=True)
    assert out["eval/n"] == 3 and out["eval/failed"] == 1, "no retry in an evaluation"
    assert out["eval/reward/mean"] == 1.0
    assert "eval/accuracy" not in out, "no episode was judged"


def test_an_evaluation_beside_training_lets_rollouts_go_first_on_the_version_given(
    tmp_path: Path,
) -> None:
    policy = FakePolicy()
    policy.version = 3
    pinned = policy.acquire()
    policy.version = 4  # training moved on
    evaluator = Evaluator(_config(tmp_path), Judged(), tasks(2), [], 256)
    out = run(
        evaluator.evaluate(policy, SyncPause(), background=True, version=pinned), virtual=True
    )
    assert out["eval/policy_version"] == 3
    assert policy.priorities == [1, 1]
    assert policy.live == {3: 1}, "the caller's pin is the caller's to release"


def test_without_eval_tasks_nothing_is_scored_or_scheduled(tmp_path: Path) -> None:
    policy = FakePolicy()
    evaluator = Evaluator(_config(tmp_path), Judged(), [], [], 256)
    assert run(evaluator.evaluate(policy, SyncPause()), virtual=True) == {}
    schedule = EvalSchedule(evaluator, _config(tmp_path), policy, SyncPause())
    assert not schedule.enabled

    async def after_step() -> list[dict[str, float]]:
        async with asyncio.TaskGroup() as scope:
            return await schedule.after_step(1, scope)

    assert run(after_step(), virtual=True) == [] and policy.calls == 0


def test_evaluations_run_beside_the_steps_one_at_a_time_the_waiting_one_replaced(
    tmp_path: Path,
) -> None:
    """Each evaluation takes 10 s; steps end every second: the one of step 1 runs, step 2's waits
    for it, step 3's replaces it and step 4's replaces that; the last step waits for them and runs
    the final one."""
    policy = FakePolicy(latency=lambda: 10.0)
    evaluator = Evaluator(_config(tmp_path), Judged(), tasks(2), [], 256)
    schedule = EvalSchedule(evaluator, _config(tmp_path), policy, SyncPause())

    async def steps() -> list[list[dict[str, float]]]:
        finished = []
        async with asyncio.TaskGroup() as scope:
            for step in range(1, 6):
                policy.version = step
                finished.append(await schedule.after_step(step, scope))
                await asyncio.sleep(1.0)
        return finished

    finished = run(steps(), virtual=True)
    assert finished[:4] == [[], [], [], []], "no step waits for an evaluation before the last"
    versions = [out["eval/policy_version"] for out in finished[4]]
    assert versions == [1, 4, 5], "steps 2 and 3's evaluations replaced, then the final one"
    assert finished[4][1]["eval/skipped"] == 2.0
    assert "eval/skipped" not in finished[4][0] and "eval/skipped" not in finished[4][2]
    assert schedule.evaluated_version == 5
    assert policy.live == {}, "every pinned version released"


def test_a_saved_checkpoint_is_scored_on_its_own_version(tmp_path: Path) -> None:
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text("".join(json.dumps(t) + "\n" for t in tasks(3)))
    config = make_config(
        tmp_path,
        workflow={"cls": "tests.test_evaluation.Judged", "args": {"right": ["t2"]}},
        data={"eval": {"path": str(eval_file)}},
    )
    saved = FakeBackend()
    saved.policy().version = 7

    async def save() -> Path:
        return await checkpoint.save(
            tmp_path / "run", saved, 7, lambda: CheckpointState(7, {}), None
        )

    path = run(save(), virtual=True)
    backend = FakeBackend()
    out = run(evaluate_checkpoint(config, path, backend), virtual=True)
    assert out["eval/policy_version"] == 7 and out["eval/n"] == 3
    assert out["eval/accuracy"] == 1 / 3
    assert backend.closed
