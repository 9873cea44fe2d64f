"""Held-out evaluation: the Evaluator scores the eval tasks on one pinned policy version; EvalSchedule
says when evaluations run during a fit; `evaluate_checkpoint` scores a saved checkpoint."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from rllm_async import checkpoint
from rllm_async.callbacks import Callback
from rllm_async.concurrency_controller import starting_concurrency
from rllm_async.config import Config
from rllm_async.data import load_tasks
from rllm_async.metrics import MetricsAggregator
from rllm_async.protocols import Backend, PolicyClient, SamplingParams
from rllm_async.rollout import Pause, SyncPause
from rllm_async.runner import Rollout, build_workflow, configured_parser, run_rollout
from rllm_async.step_record import record_episode
from rllm_async.workflows.base import Workflow


class Evaluator:
    """Runs every eval task once on one pinned policy version, `max_concurrency` rollouts at once
    (`starting_concurrency`), and reduces the episodes into `eval/*` metrics; callbacks hear of
    each evaluation."""

    def __init__(
        self,
        config: Config,
        workflow: Workflow,
        tasks: list[dict[str, Any]],
        callbacks: list[Callback],
        max_concurrency: int,
    ) -> None:
        self.config = config
        self.max_concurrency = max_concurrency
        self.workflow = workflow
        self.tasks = tasks
        self.callbacks = callbacks

    async def evaluate(
        self,
        policy: PolicyClient,
        pause: Pause,
        *,
        background: bool = False,
        version: int | None = None,
    ) -> dict[str, float]:
        """The `eval/*` metrics of `version` (one the caller acquired and releases; None: the
        current version, acquired here). `background`: its requests let rollouts go first for a
        while (`SamplingParams.priority` 1)."""
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
        owned = version is None
        pinned = policy.acquire() if version is None else version
        slots = asyncio.Semaphore(self.max_concurrency)

        async def one(task: dict[str, Any]) -> Rollout:
            async with slots:
                return await run_rollout(
                    self.workflow,
                    task,
                    policy,
                    sampling=sampling,
                    pin=True,
                    version=pinned,
                    timeout_s=cfg.rollout.timeout_s,
                    retries=0,
                    pause=pause,
                    parser=configured_parser(cfg, policy),
                )

        try:
            rollouts = await asyncio.gather(*(one(t) for t in self.tasks))
        finally:
            if owned:
                policy.release(pinned)
        episodes = [r.episode for r in rollouts]
        done = [e for e in episodes if e is not None]
        reduced = MetricsAggregator()
        for episode in done:
            record_episode(reduced, "eval/episode/", episode, self.workflow.metric_reductions)
        out = {
            **reduced.take(),
            "eval/policy_version": float(pinned),
            "eval/n": float(len(done)),
            "eval/failed": float(len(episodes) - len(done)),
            # of those, the ones whose infrastructure failed: not scored, as in training
            "eval/infra_failed": float(sum(r.infra_failed for r in rollouts)),
            "eval/time_s": loop.time() - t0,
        }
        if done:
            out["eval/reward/mean"] = sum(e.reward for e in done) / len(done)
            judged = [e.is_correct for e in done if e.is_correct is not None]
            if judged:
                out["eval/accuracy"] = sum(judged) / len(judged)
        for cb in self.callbacks:
            cb.on_eval_end(pinned, out)
        return out


class EvalSchedule:
    """When the evaluations of one fit run. One due after a step pins that step's version at once
    and runs beside the next steps once the one before it ends (one samples at a time); it lands
    in the first record written after it finishes. One due while another still waits to start
    replaces it (`eval/skipped` counts those), so at most two versions stay pinned. The training
    loop never waits for one before its last step, whose records hold every evaluation, the final
    one run there."""

    def __init__(
        self,
        evaluator: Evaluator,
        config: Config,
        policy: PolicyClient,
        pause: Pause,
    ) -> None:
        self.evaluator = evaluator
        self.config = config
        self.policy = policy
        self.pause = pause
        self.enabled = bool(evaluator.tasks)
        self.evaluated_version = -1
        self._beside: list[asyncio.Task[dict[str, float]]] = []  # in the order they were due
        self._waiting: asyncio.Task[dict[str, float]] | None = None  # the last, not yet started
        self._skipped = 0  # evaluations replaced since the last one started

    async def evaluate(self) -> dict[str, float]:
        """Evaluate the current policy now."""
        out = await self.evaluator.evaluate(self.policy, self.pause)
        self.evaluated_version = int(out["eval/policy_version"])
        return out

    async def after_step(self, step: int, scope: asyncio.TaskGroup) -> list[dict[str, float]]:
        """Start the evaluation due at `step` beside training (in `scope`); returns the metrics of
        evaluations finished by now, oldest first, one record's worth each. At the last step,
        waits for those still running and runs the final one."""
        if not self.enabled:
            return []
        cfg = self.config
        every, last = cfg.eval.every_steps, step >= cfg.train.total_steps
        due = bool(every) and step % every == 0
        if due and not last:
            if self._waiting is not None:
                self._waiting.cancel()  # its pin is released as it ends
                self._beside.remove(self._waiting)
                self._skipped += 1
            version = self.policy.acquire()
            after = self._beside[-1] if self._beside else None
            task = scope.create_task(self._pinned(version, after), name=f"rllm-async:eval-{step}")
            self._beside.append(task)
            self._waiting = task if after is not None else None
        finished = await self.collect(wait=last)
        if last and (due or cfg.eval.at_end):
            finished.append(await self.evaluate())
        return finished

    async def _pinned(
        self, version: int, after: asyncio.Task[dict[str, float]] | None
    ) -> dict[str, float]:
        """Evaluate the acquired `version` once the evaluation `after` ended; release it."""
        try:
            if after is not None:
                await asyncio.wait([after])
            self._waiting = None
            skipped, self._skipped = self._skipped, 0
            out = await self.evaluator.evaluate(
                self.policy, self.pause, background=True, version=version
            )
        finally:
            self.policy.release(version)
        if skipped:
            out["eval/skipped"] = float(skipped)
        self.evaluated_version = max(self.evaluated_version, version)
        return out

    async def collect(self, *, wait: bool) -> list[dict[str, float]]:
        """The metrics of the evaluations beside training that have finished (with `wait`, of all
        of them, once they finish), oldest first."""
        if wait and self._beside:
            await asyncio.wait(self._beside)
        done = 0
        while done < len(self._beside) and self._beside[done].done():
            done += 1
        finished = [task.result() for task in self._beside[:done]]
        del self._beside[:done]
        return finished


async def evaluate_checkpoint(config: Config, path: Path, backend: Backend) -> dict[str, float]:
    """Load the checkpoint at `path` into `backend`, score it on `data.eval`, close both."""
    assert config.data.eval is not None
    tasks = load_tasks(config.data.eval, "eval")
    workflow = build_workflow(config)
    try:
        await workflow.start(backend.policy())
        await checkpoint.load(path, backend)
        # No weight sync pauses a checkpoint's evaluation.
        evaluator = Evaluator(config, workflow, tasks, [], starting_concurrency(config, backend))
        return await evaluator.evaluate(backend.policy(), SyncPause())
    finally:
        try:
            await workflow.close()
        finally:
            await backend.close()
