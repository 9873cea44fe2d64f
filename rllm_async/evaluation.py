"""Held-out evaluation: the Evaluator scores the eval tasks on one pinned policy version; EvalSchedule
says when evaluations run during a fit; `evaluate_checkpoint` scores a saved checkpoint."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from rllm_async import checkpoint
from rllm_async.backends.base import Backend, PolicyClient, SamplingParams
from rllm_async.callbacks import Callback
from rllm_async.config import Config
from rllm_async.data import load_tasks
from rllm_async.metrics import MetricsAggregator
from rllm_async.runner import build_workflow, configured_parser, run_rollout
from rllm_async.step_record import record_episode
from rllm_async.workflows.base import Workflow


class Evaluator:
    """Runs every eval task once on one pinned policy version and reduces the episodes into
    `eval/*` metrics; callbacks hear of each evaluation."""

    def __init__(
        self,
        config: Config,
        workflow: Workflow,
        tasks: list[dict[str, Any]],
        callbacks: list[Callback],
    ) -> None:
        self.config = config
        self.workflow = workflow
        self.tasks = tasks
        self.callbacks = callbacks

    async def evaluate(
        self,
        policy: PolicyClient,
        wait_unpaused: Callable[[], Awaitable[None]],
        *,
        background: bool = False,
    ) -> dict[str, float]:
        """The `eval/*` metrics of the current policy version. `background`: its requests queue
        behind rollouts (`SamplingParams.priority` 1)."""
        if not self.tasks:
            return {}
        cfg = self.config
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        sampling = SamplingParams(
            temperature=cfg.eval.temperature,
            top_p=1.0,
            max_tokens=cfg.eval.max_tokens or cfg.rollout.max_tokens,
            priority=int(background),
        )
        version = policy.acquire()
        slots = asyncio.Semaphore(cfg.rollout.max_concurrency)

        async def one(task: dict[str, Any]) -> Any:
            async with slots:
                rollout = await run_rollout(
                    self.workflow,
                    task,
                    policy,
                    sampling=sampling,
                    pin=True,
                    version=version,
                    timeout_s=cfg.rollout.timeout_s,
                    retries=0,
                    wait_unpaused=wait_unpaused,
                    parser=configured_parser(cfg, policy),
                )
                return rollout.episode

        try:
            episodes = await asyncio.gather(*(one(t) for t in self.tasks))
        finally:
            policy.release(version)
        done = [e for e in episodes if e is not None]
        reduced = MetricsAggregator()
        for episode in done:
            record_episode(reduced, "eval/episode/", episode, self.workflow.metric_reductions)
        out = {
            **reduced.take(),
            "eval/policy_version": float(version),
            "eval/n": float(len(done)),
            "eval/failed": float(len(episodes) - len(done)),
            "eval/time_s": loop.time() - t0,
        }
        if done:
            out["eval/reward/mean"] = sum(e.reward for e in done) / len(done)
            judged = [e.is_correct for e in done if e.is_correct is not None]
            if judged:
                out["eval/accuracy"] = sum(judged) / len(judged)
        for cb in self.callbacks:
            cb.on_eval_end(version, out)
        return out


class EvalSchedule:
    """When the evaluations of one fit run. One due after a step runs beside the next steps and
    lands in the first record written after it finishes; near the end (and the final one) it runs
    inline, so that the last records hold every evaluation. At most one runs beside training."""

    def __init__(
        self,
        evaluator: Evaluator,
        config: Config,
        policy: PolicyClient,
        wait_unpaused: Callable[[], Awaitable[None]],
    ) -> None:
        self.evaluator = evaluator
        self.config = config
        self.policy = policy
        self.wait_unpaused = wait_unpaused
        self.enabled = bool(evaluator.tasks)
        self.evaluated_version = -1
        self._beside: asyncio.Task[dict[str, float]] | None = None

    async def evaluate(self, *, background: bool = False) -> dict[str, float]:
        """Evaluate the current policy now."""
        out = await self.evaluator.evaluate(self.policy, self.wait_unpaused, background=background)
        self.evaluated_version = int(out["eval/policy_version"])
        return out

    async def after_step(self, step: int, scope: asyncio.TaskGroup) -> dict[str, float]:
        """Start or run the evaluation due at `step` (in `scope` when it runs beside training);
        returns the metrics of evaluations finished by now, for the step's record."""
        if not self.enabled:
            return {}
        cfg = self.config
        total, every = cfg.train.total_steps, cfg.eval.every_steps
        due = (every and step % every == 0) or (step >= total and cfg.eval.at_end)
        ending = step + 1 >= total
        # At most one evaluation runs beside training: a due one waits for the previous.
        out = await self.collect(wait=bool(due) or ending) or {}
        if due and ending:
            out.update(await self.evaluate())
        elif due:
            self._beside = scope.create_task(
                self.evaluate(background=True), name=f"rllm-async:evaluation-{step}"
            )
        return out

    async def collect(self, *, wait: bool) -> dict[str, float] | None:
        """The metrics of the evaluation beside training if it has finished (or, with `wait`, once
        it finishes); None if there is none."""
        task = self._beside
        if task is None or not (wait or task.done()):
            return None
        self._beside = None
        return await task


async def evaluate_checkpoint(config: Config, path: Path, backend: Backend) -> dict[str, float]:
    """Load the checkpoint at `path` into `backend`, score it on `data.eval`, close both."""
    assert config.data.eval is not None
    tasks = load_tasks(config.data.eval, "eval")
    workflow = build_workflow(config)
    try:
        await workflow.start(backend.policy())
        await checkpoint.load(path, backend)
        return await Evaluator(config, workflow, tasks, []).evaluate(
            backend.policy(), _never_paused
        )
    finally:
        try:
            await workflow.close()
        finally:
            await backend.close()


async def _never_paused() -> None:
    """No weight sync pauses a checkpoint's evaluation."""
