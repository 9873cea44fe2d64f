"""UnifiedTrainer: one generation loop and one training loop under one structured-concurrency scope."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import shutil
from collections import deque
from pathlib import Path
from typing import Any, get_args

from rllm_async.algorithms.advantages import get_advantage_fn
from rllm_async.backends import get_backend_factory
from rllm_async.backends.base import Backend, SamplingParams
from rllm_async.buffer import Dispatch, ReadyGroup, TrajectoryGroupBuffer
from rllm_async.callbacks import Callback
from rllm_async.config import Config, ConfigError
from rllm_async.coordinator import State, SyncCoordinator
from rllm_async.data import TaskSource, load_tasks
from rllm_async.imports import import_object
from rllm_async.metrics import (
    JsonlSink,
    MetricsAggregator,
    MetricsSink,
    ProgressBarSink,
    Reduce,
    WandbSink,
)
from rllm_async.rollout import RolloutContext
from rllm_async.types import Episode
from rllm_async.workflows.base import Workflow

log = logging.getLogger(__name__)

_BREAKER_MIN_ROLLOUTS = 32
# Filtered groups in a row, in steps' worth, that make the run warn that it learns nothing.
_NO_SIGNAL_WARNING_STEPS = 3
# Group outcomes counted per record, as the change since the previous record.
_GROUP_COUNTS = (
    "dispatched",
    "consumed",
    "filtered",
    "failed",
    "dropped_stale",
    "cancelled",
    "requeued",
)


class FailureRateError(RuntimeError):
    """Too many rollouts failed recently (`rollout.max_failure_rate`); the run stops."""


class NoSignalError(RuntimeError):
    """`algorithm.no_signal_steps` steps' worth of groups in a row were filtered: nothing is learned."""


class UnifiedTrainer:
    """Trains `config.workflow` on `config.backend`, sync or async, with bounded staleness.

    The generation loop dispatches a task whenever the coordinator admits one and starts its
    `group_size` rollouts; the training loop streams ready groups into `forward_backward` every
    `micro_batch_groups` groups and steps the optimizer every `groups_per_step` groups. `sync` mode
    is the same code with pipeline depth 0, no staleness and pinned weights.
    """

    def __init__(
        self,
        config: Config,
        *,
        backend: Backend | None = None,
        workflow: Workflow | None = None,
        callbacks: list[Callback] | None = None,
        train_tasks: list[dict[str, Any]] | None = None,
        eval_tasks: list[dict[str, Any]] | None = None,
    ) -> None:
        self.config = config
        self.callbacks = list(callbacks or [])
        try:
            self.advantage_fn = get_advantage_fn(config.algorithm.advantage)
        except KeyError as e:
            raise ConfigError(str(e.args[0])) from None
        self.train_tasks = train_tasks if train_tasks is not None else self._load("train")
        self.eval_tasks = eval_tasks if eval_tasks is not None else self._load("eval")
        self.workflow = workflow if workflow is not None else _build_workflow(config)
        for key, reduce in self.workflow.metric_reductions.items():
            if reduce not in get_args(Reduce):
                raise ConfigError(
                    f"{type(self.workflow).__name__}.metric_reductions[{key!r}] is {reduce!r}: "
                    f"use one of {', '.join(get_args(Reduce))}"
                )
        if backend is None:
            factory = get_backend_factory(config.backend.name)
            self.virtual_clock = bool(getattr(factory, "virtual_clock", False))
            backend = factory.from_config(config)
        else:
            self.virtual_clock = bool(getattr(backend, "virtual_clock", False))
        self.backend = backend
        self.coordinator = SyncCoordinator(
            config.coordinator, config.train.groups_per_step, backend.on_policy_updated
        )
        self.records: list[dict[str, float]] = []

    def _load(self, split: str) -> list[dict[str, Any]]:
        spec = getattr(self.config.data, split)
        if spec is None:
            if split == "train":
                raise ConfigError(
                    "data.train is not set: give data.train.path (a JSONL file of tasks) or "
                    "data.train.generator (a callable returning task dicts)"
                )
            return []
        return load_tasks(spec, split)

    # -- entry points -------------------------------------------------------------------------

    def run(self) -> list[dict[str, float]]:
        """Run `fit()` to completion on a fresh event loop (a virtual clock for simulators)."""
        from rllm_async.vclock import run

        return run(self.fit(), virtual=self.virtual_clock)

    async def fit(self) -> list[dict[str, float]]:
        """Train until `train.total_steps` (or the end of the data); returns the step records."""
        self._setup()
        try:
            if self._resume_from is not None:
                await self._resume(*self._resume_from)
            for cb in self.callbacks:
                cb.on_train_start(self.coordinator.version)
            if self.config.eval.at_start and self.eval_tasks and self.coordinator.version == 0:
                await self._evaluate_at_start()
            async with asyncio.TaskGroup() as scope:
                generation = scope.create_task(self._generate(), name="rllm-async:generation")
                scope.create_task(self._train(generation), name="rllm-async:training")
        except BaseExceptionGroup as group:
            raise _first_error(group) from None
        finally:
            await self._teardown()
        return self.records

    # -- setup and teardown -------------------------------------------------------------------

    def _setup(self) -> None:
        cfg = self.config
        loop = asyncio.get_running_loop()
        self.run_path = cfg.run_path
        self.run_path.mkdir(parents=True, exist_ok=True)
        _write_config(cfg, self.run_path / "config.yaml")
        self.buffer = TrajectoryGroupBuffer(
            self.coordinator,
            group_size=cfg.rollout.group_size,
            min_group_size=cfg.rollout.min_group_size,
            advantage_fn=self.advantage_fn,
            normalize_std=cfg.algorithm.normalize_std,
            filter_zero_variance=cfg.algorithm.filter_zero_variance,
            filter_unsolved=cfg.algorithm.filter_unsolved,
            capacity=(cfg.coordinator.pipeline_depth + 1) * cfg.train.groups_per_step,
        )
        self.source = TaskSource(
            self.train_tasks,
            seed=cfg.seed,
            shuffle=cfg.data.train.shuffle if cfg.data.train is not None else True,
            total_epochs=cfg.train.total_epochs,
            skip_solved=cfg.algorithm.skip_solved,
            on_epoch_start=self._epoch_started,
            on_epoch_end=self._epoch_ended,
        )
        self.policy = self.backend.policy()
        self.sampling = SamplingParams(
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            max_tokens=cfg.rollout.max_tokens,
        )
        self._pin = cfg.coordinator.weight_update == "pin"
        self._slots = asyncio.Semaphore(cfg.rollout.max_concurrency)
        self._dispatch_ids = itertools.count()
        self._outstanding: dict[int, Dispatch] = {}
        self._outcomes: deque[bool] = deque(maxlen=cfg.rollout.failure_window)
        self._failures_in_window = 0
        self._filtered_in_a_row = 0
        self._last_error = ""
        self._checkpointed = -1
        self._eval_task: asyncio.Task[dict[str, float]] | None = None
        self._evaluated_version = -1
        self._resume_from = self._find_resume_checkpoint()
        self.metrics = MetricsAggregator(self._sinks())
        self._fit_start = self._step_start = loop.time()
        self._step_counts = self.coordinator.snapshot()
        self._step_episodes = 0
        self._step_tokens = 0

    def _epoch_started(self, epoch: int) -> None:
        for cb in self.callbacks:
            cb.on_epoch_start(epoch)

    def _epoch_ended(self, epoch: int) -> None:
        for cb in self.callbacks:
            cb.on_epoch_end(epoch)

    def _sinks(self) -> list[MetricsSink]:
        cfg = self.config
        sinks: list[MetricsSink] = []
        if cfg.logging.jsonl:
            sinks.append(JsonlSink(self.run_path / "metrics.jsonl"))
        if cfg.logging.progress_bar:
            initial = self._resume_from[1]["version"] if self._resume_from else 0
            sinks.append(ProgressBarSink(cfg.train.total_steps, initial=initial, desc=cfg.name))
        if cfg.logging.wandb.enabled:
            w = cfg.logging.wandb
            config = cfg.model_dump(mode="json")
            sinks.append(WandbSink(w.project, cfg.name, w.entity, w.mode, config, self.run_path))
        return sinks

    async def _teardown(self) -> None:
        coord = self.coordinator
        self._cancel_outstanding()
        # A run that ended early (an error, an interrupt): what ended since its last record.
        if self._record_group_counts(coord.snapshot()):
            self._flush_extra_record(coord.version)
        self.metrics.close()
        try:
            try:
                await asyncio.wait_for(self.workflow.close(), timeout=30)
            finally:
                await asyncio.wait_for(self.backend.close(), timeout=30)
        finally:
            for cb in self.callbacks:
                cb.on_train_end(coord.version)

    # -- generation ----------------------------------------------------------------------------

    async def _generate(self) -> None:
        """Dispatch tasks as admission allows, fire and forget; close the buffer at the data's end."""
        coord, source = self.coordinator, self.source
        async with asyncio.TaskGroup() as rollouts:
            while True:
                await coord.wait_admissible()
                task = source.pop()
                if task is None:
                    # A stale group may still hand its task back; wait until none can.
                    await coord.wait_for(
                        lambda: bool(source.requeued) or coord.outstanding == 0, "end of data"
                    )
                    if source.requeued:
                        continue
                    break
                coord.dispatch()
                dispatch = Dispatch(next(self._dispatch_ids), task, task["id"], coord.version)
                self._outstanding[dispatch.id] = dispatch
                self.buffer.open(dispatch)
                for index in range(self.config.rollout.group_size):
                    rollouts.create_task(self._rollout(dispatch, index))
                # Admission may allow hundreds of groups at once: let the loop breathe between them.
                await asyncio.sleep(0)
        self.buffer.close()

    async def _rollout(self, dispatch: Dispatch, index: int) -> None:
        async with self._slots:
            self.coordinator.rollout_started()
            try:
                episode = await self._attempts(dispatch, index)
            finally:
                self.coordinator.rollout_finished()
        self._record_outcome(episode)
        state = await self.buffer.add(dispatch.id, index, episode)
        if state is None:
            return
        self._record_solved(dispatch)
        solved = dispatch.correct == self.config.rollout.group_size
        self.source.group_ended(dispatch.task, solved=solved)
        if state in (State.FILTERED, State.FAILED):
            del self._outstanding[dispatch.id]
            self.metrics.record("tokens/wasted", dispatch.tokens, "sum")
        self._check_signal(state)

    async def _attempts(self, dispatch: Dispatch, index: int) -> Episode | None:
        """Run one rollout with its deadline, retrying failures; None when every attempt failed."""
        ro, loop, m = self.config.rollout, asyncio.get_running_loop(), self.metrics
        for attempt in range(ro.retries + 1):
            if attempt:
                m.record("rollout/retries", 1, "sum")
            ctx = RolloutContext(
                self.policy,
                sampling=self.sampling,
                pin=self._pin,
                wait_unpaused=self.coordinator.wait_unpaused,
                deadline=loop.time() + ro.timeout_s,
                task_id=dispatch.task_id,
                rollout_index=index,
                attempt=attempt,
            )
            try:
                async with ctx.timeout():
                    result = await self.workflow.run(dispatch.task, ctx)
                episode = ctx.build_episode(result)
            except TimeoutError:
                m.record("rollout/timeouts", 1, "sum")
                self._last_error = f"rollout timed out after rollout.timeout_s={ro.timeout_s}s"
                self._count_tokens(ctx.num_completion_tokens, wasted=True)
                continue
            except Exception as e:
                m.record("rollout/errors", 1, "sum")
                self._last_error = f"{type(e).__name__}: {e}"
                self._count_tokens(ctx.num_completion_tokens, wasted=True)
                continue
            finally:
                ctx.close()
            episode.task_id = dispatch.task_id
            m.record("rollout/reward/mean", episode.reward)
            tokens = episode.num_completion_tokens
            m.record("episode/completion_tokens", tokens)
            self._record_episode_metrics(m, "episode/", episode)
            dispatch.tokens += tokens
            if episode.is_correct is not None:
                dispatch.judged += 1
                dispatch.correct += episode.is_correct
            self._count_tokens(tokens, wasted=False)
            self._step_episodes += 1
            return episode
        m.record("rollout/failures", 1, "sum")
        return None

    def _record_episode_metrics(self, m: MetricsAggregator, prefix: str, episode: Episode) -> None:
        """An episode's own metrics, reduced as its workflow declares (mean by default)."""
        reductions = self.workflow.metric_reductions
        for key, value in episode.metrics.items():
            m.record(prefix + key, value, reductions.get(key, "mean"))

    def _record_solved(self, dispatch: Dispatch) -> None:
        """Count a completed group whose rollouts were all judged as solved by all or by none: the
        groups that teach nothing, by kind, whether or not they are filtered."""
        n = self.config.rollout.group_size
        if dispatch.judged == n:
            self.metrics.record("groups/solve_all", float(dispatch.correct == n), "sum")
            self.metrics.record("groups/solve_none", float(dispatch.correct == 0), "sum")

    def _check_signal(self, state: State) -> None:
        """Warn when the groups of a few steps in a row were all filtered, and stop the run when
        `algorithm.no_signal_steps` steps' worth were: no step can be taken on them."""
        if state is not State.FILTERED:
            self._filtered_in_a_row = 0
            return
        self._filtered_in_a_row += 1
        n, per_step = self._filtered_in_a_row, self.config.train.groups_per_step
        limit = self.config.algorithm.no_signal_steps
        if limit is not None and n >= limit * per_step:
            raise NoSignalError(
                f"{self._no_signal_reason()}; stopped at algorithm.no_signal_steps={limit} "
                "steps' worth of them"
            )
        if n == _NO_SIGNAL_WARNING_STEPS * per_step:
            stop = (
                f"the run stops at {limit * per_step} in a row (algorithm.no_signal_steps={limit})"
                if limit is not None
                else "algorithm.no_signal_steps is null, so the run goes on"
            )
            log.warning(f"{self._no_signal_reason()}; {stop}", extra={"status": "no signal"})

    def _no_signal_reason(self) -> str:
        """Why the last groups were all filtered, and the knobs that change it."""
        algorithm = self.config.algorithm
        why, flags = "had equal rewards within the group", ["filter_zero_variance"]
        if algorithm.filter_unsolved:
            why += " or no correct rollout"
            flags.append("filter_unsolved")
        return (
            f"the last {self._filtered_in_a_row} groups all {why} and were filtered, so there is "
            "nothing to learn from: the policy always fails (or always succeeds). Warm-start the "
            "policy, make the task easier or the reward denser, or set "
            + " or ".join(f"algorithm.{flag}=false" for flag in flags)
        )

    def _count_tokens(self, tokens: int, *, wasted: bool) -> None:
        self._step_tokens += tokens
        self.metrics.record("tokens/generated", tokens, "sum")
        if wasted:
            self.metrics.record("tokens/wasted", tokens, "sum")

    def _record_outcome(self, episode: Episode | None) -> None:
        """The failure-rate circuit breaker over the last `rollout.failure_window` rollouts."""
        failed = episode is None
        if len(self._outcomes) == self._outcomes.maxlen:
            self._failures_in_window -= self._outcomes[0]
        self._outcomes.append(failed)
        self._failures_in_window += failed
        n = len(self._outcomes)
        if n < min(self.config.rollout.failure_window, _BREAKER_MIN_ROLLOUTS):
            return
        rate = self._failures_in_window / n
        if rate > self.config.rollout.max_failure_rate:
            raise FailureRateError(
                f"{rate:.0%} of the last {n} rollouts failed (rollout.max_failure_rate="
                f"{self.config.rollout.max_failure_rate}); last error: {self._last_error}. Fix the "
                "workflow, or raise rollout.timeout_s / rollout.retries / rollout.max_failure_rate"
            )

    # -- training ------------------------------------------------------------------------------

    async def _train(self, generation: asyncio.Task[None]) -> None:
        self._generation = generation
        try:
            # Evaluations run beside training (see `_after_step`); this scope owns them.
            async with asyncio.TaskGroup() as self._eval_scope:
                while self.coordinator.version < self.config.train.total_steps:
                    if not await self._train_step():
                        await self._close_after_data_end()
                        break
        finally:
            generation.cancel()

    async def _close_after_data_end(self) -> None:
        """The data ran out after the last step's record was written: groups that ended since
        (filtered or failed), draws skipped since and an evaluation still running get one more
        record of that step, the final evaluation another; then the final checkpoint."""
        cfg, version = self.config, self.coordinator.version
        groups_ended = self._record_group_counts(self.coordinator.snapshot())
        if await self._collect_eval(wait=True) or groups_ended:
            self._flush_extra_record(version)
        if cfg.eval.at_end and self.eval_tasks and self._evaluated_version != version:
            self.metrics.record_many(await self.evaluate(), "last")
            self._flush_extra_record(version)
        if cfg.checkpoint.at_end and self._checkpointed != version:
            await self.save_checkpoint()

    async def _train_step(self) -> bool:
        """Consume one step's groups, streaming micro-batches; False when the data ran out."""
        cfg, coord, m = self.config, self.coordinator, self.metrics
        loop = asyncio.get_running_loop()
        batch: list[ReadyGroup] = []
        micro: list[ReadyGroup] = []
        idle = 0.0
        while len(batch) < cfg.train.groups_per_step:
            t0 = loop.time()
            ready = await self.buffer.get()
            idle += loop.time() - t0
            if ready is None:
                break
            del self._outstanding[ready.dispatch.id]
            if coord.too_stale(ready.min_version):
                requeue = cfg.coordinator.stale_policy == "requeue"
                coord.move(State.BUFFERED, State.DROPPED_STALE, requeued=requeue)
                m.record("tokens/wasted", ready.dispatch.tokens, "sum")
                if requeue:
                    self.source.requeue(ready.dispatch.task)
                continue
            coord.move(State.BUFFERED, State.CONSUMED)
            for episode in ready.episodes:
                m.record("reward/mean", episode.reward)
                if episode.is_correct is not None:
                    m.record("episode/correct", float(episode.is_correct))
            staleness = coord.staleness(ready.min_version)
            m.record("staleness/mean", staleness)
            m.record("staleness/max", staleness, "max")
            batch.append(ready)
            micro.append(ready)
            if len(micro) == cfg.train.micro_batch_groups:
                await self._forward_backward(micro)
                micro = []
        if not batch:
            return False
        if micro:
            await self._forward_backward(micro)
        t0 = loop.time()
        m.record_many(await self.backend.optim_step(), "last")
        m.record("time/optim_step_s", loop.time() - t0, "sum")
        hook_s, sync_s = await coord.update_policy(coord.version + 1)
        m.record("time/sync_s", sync_s, "sum")
        m.record("time/sync_overhead_s", sync_s - hook_s, "sum")
        m.record("async/trainer_idle_s", idle, "sum")
        await self._after_step(len(batch))
        return True

    async def _forward_backward(self, micro: list[ReadyGroup]) -> None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        groups = [g for ready in micro for g in ready.groups]
        out = await self.backend.forward_backward(groups, self.config.algorithm.loss)
        self.metrics.record_many(out, "mean")
        self.metrics.record("time/forward_backward_s", loop.time() - t0, "sum")

    async def _after_step(self, num_groups: int) -> None:
        """Close the step: its record, then evaluation and checkpoint when due."""
        cfg, coord, m = self.config, self.coordinator, self.metrics
        loop = asyncio.get_running_loop()
        step = coord.version
        last = step >= cfg.train.total_steps or self.buffer.finished
        if last:
            await self._stop_generation()
        now = loop.time()
        step_s = max(now - self._step_start, 1e-12)
        counts = coord.snapshot()
        self._record_group_counts(counts)
        m.record("groups/in_flight", counts["in_flight"], "last")
        m.record("groups/buffered", counts["buffered"], "last")
        m.record("policy_version", step, "last")
        m.record("time/step_s", step_s, "last")
        m.record("time/elapsed_s", now - self._fit_start, "last")
        m.record(
            "async/trainer_idle_ratio", (m.peek("async/trainer_idle_s") or 0.0) / step_s, "last"
        )
        m.record("async/generation_idle_ratio", coord.take_generation_idle() / step_s, "last")
        m.record("episodes/per_s", self._step_episodes / step_s, "last")
        m.record("tokens/per_s", self._step_tokens / step_s, "last")
        m.record("data/epoch", self.source.epoch, "last")
        m.record("train/groups", num_groups, "last")
        if self.eval_tasks:
            await self._evaluate_after_step(step)
        record = m.flush(step)
        self.records.append(record)
        for cb in self.callbacks:
            cb.on_step_end(step, record)
        ck = cfg.checkpoint
        if (ck.every_steps and step % ck.every_steps == 0) or (last and ck.at_end):
            await self.save_checkpoint()
        self._step_start = loop.time()
        self._step_episodes = self._step_tokens = 0

    async def _stop_generation(self) -> None:
        """Stop dispatching and cancel the rollouts still running, so that the last step's record
        counts every group generated."""
        self._generation.cancel()
        await asyncio.wait([self._generation])
        self._cancel_outstanding()

    def _cancel_outstanding(self) -> None:
        """Cancel the groups still in flight or buffered; the tokens they generated are wasted."""
        coord = self.coordinator
        if not coord.outstanding:
            return
        for _ in self.buffer.drain():
            coord.move(State.BUFFERED, State.CANCELLED)
        for _ in range(coord.counts.in_flight):
            coord.move(State.IN_FLIGHT, State.CANCELLED)
        wasted = sum(d.tokens for d in self._outstanding.values())
        self.metrics.record("tokens/wasted", wasted, "sum")

    def _record_group_counts(self, counts: dict[str, int]) -> bool:
        """Record how many groups ended each way, and how many draws were skipped as solved,
        since the last record; False if none did and none was."""
        changes = {key: counts[key] - self._step_counts[key] for key in _GROUP_COUNTS}
        for key, n in changes.items():
            self.metrics.record(f"groups/{key}", n, "sum")
        self._step_counts = counts
        skipped = self.source.take_skipped()
        if self.config.algorithm.skip_solved:
            self.metrics.record("data/skipped_solved", skipped, "sum")
        return any(changes.values()) or skipped > 0

    def _flush_extra_record(self, step: int) -> None:
        """One more record of `step`, for evaluations that finished after its record was written."""
        elapsed = asyncio.get_running_loop().time() - self._fit_start
        self.metrics.record("time/elapsed_s", elapsed, "last")
        self.records.append(self.metrics.flush(step))

    # -- evaluation ----------------------------------------------------------------------------

    async def _evaluate_after_step(self, step: int) -> None:
        """Evaluate when due. An evaluation runs beside the next steps and lands in the first
        record written after it finishes; near the end (and for the final one) it runs inline,
        so that the last records hold every evaluation. The data running out early is handled
        by `_close_after_data_end`."""
        cfg = self.config
        total, every = cfg.train.total_steps, cfg.eval.every_steps
        due = (every and step % every == 0) or (step >= total and cfg.eval.at_end)
        ending = step + 1 >= total
        # At most one evaluation runs beside training: a due one waits for the previous.
        await self._collect_eval(wait=bool(due) or ending)
        if due and ending:
            self.metrics.record_many(await self.evaluate(), "last")
        elif due:
            self._eval_task = self._eval_scope.create_task(
                self.evaluate(background=True), name=f"rllm-async:evaluation-{step}"
            )

    async def _collect_eval(self, *, wait: bool) -> bool:
        """Record the metrics of the evaluation running beside training if it has finished (or,
        with `wait`, once it finishes) into the current step's record; True if it recorded any."""
        task = self._eval_task
        if task is None or not (wait or task.done()):
            return False
        self._eval_task = None
        self.metrics.record_many(await task, "last")
        return True

    async def _evaluate_at_start(self) -> None:
        """Score the starting policy as a record of step 0, outside the timed run."""
        self.metrics.record_many(await self.evaluate(), "last")
        self.metrics.record("time/elapsed_s", 0.0, "last")  # the run's clock starts after it
        self.records.append(self.metrics.flush(0))
        self._fit_start = self._step_start = asyncio.get_running_loop().time()

    async def evaluate(self, *, background: bool = False) -> dict[str, float]:
        """Run every eval task once on one pinned policy version; returns `eval/*` metrics.
        `background`: its requests queue behind rollouts (`SamplingParams.priority` 1)."""
        if not self.eval_tasks:
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
        version = self._evaluated_version = self.policy.acquire()
        slots = asyncio.Semaphore(cfg.rollout.max_concurrency)

        async def one(task: dict[str, Any]) -> Episode | None:
            async with slots:
                ctx = RolloutContext(
                    self.policy,
                    sampling=sampling,
                    pin=True,
                    version=version,
                    wait_unpaused=self.coordinator.wait_unpaused,
                    deadline=loop.time() + cfg.rollout.timeout_s,
                    task_id=task["id"],
                )
                try:
                    async with ctx.timeout():
                        return ctx.build_episode(await self.workflow.run(task, ctx))
                except Exception:
                    return None
                finally:
                    ctx.close()

        try:
            episodes = await asyncio.gather(*(one(t) for t in self.eval_tasks))
        finally:
            self.policy.release(version)
        done = [e for e in episodes if e is not None]
        reduced = MetricsAggregator()
        for episode in done:
            self._record_episode_metrics(reduced, "eval/episode/", episode)
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

    async def evaluate_checkpoint(self, path: Path | None) -> dict[str, float]:
        """Load a checkpoint (None: the initial policy), evaluate it on `data.eval`, close."""
        self.policy = self.backend.policy()
        try:
            if path is not None:
                state = json.loads((path / "trainer_state.json").read_text())
                await self.backend.load(path / "backend")
                self.coordinator.version = state["version"]
            return await self.evaluate()
        finally:
            try:
                await self.workflow.close()
            finally:
                await self.backend.close()

    # -- checkpoints ---------------------------------------------------------------------------

    async def save_checkpoint(self) -> Path:
        """Write `checkpoints/step_<N>/` atomically: backend state + trainer state, then rename."""
        step = self.coordinator.version
        root = self.run_path / "checkpoints"
        final, tmp = root / f"step_{step}", root / f".step_{step}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        await self.backend.save(tmp / "backend")
        pending = [d.task for d in sorted(self._outstanding.values(), key=lambda d: d.id)]
        state = {"version": step, "source": self.source.state(pending)}
        (tmp / "trainer_state.json").write_text(json.dumps(state))
        self._checkpointed = step
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        keep = self.config.checkpoint.keep_last
        if keep is not None:
            for old in _checkpoints(root)[:-keep]:
                shutil.rmtree(old)
        return final

    def _find_resume_checkpoint(self) -> tuple[Path, dict[str, Any]] | None:
        resume = self.config.checkpoint.resume
        if resume == "never":
            return None
        if resume == "auto":
            latest = latest_checkpoint(self.run_path)
            if latest is None:
                return None
            path = latest
        else:
            path = Path(resume)
            if not (path / "trainer_state.json").exists():
                raise ConfigError(
                    f"checkpoint.resume: {path} is not a checkpoint directory (no trainer_state.json); "
                    "use auto, never, or a runs/<name>/checkpoints/step_<N> directory"
                )
        return path, json.loads((path / "trainer_state.json").read_text())

    async def _resume(self, path: Path, state: dict[str, Any]) -> None:
        await self.backend.load(path / "backend")
        await self.backend.on_policy_updated(state["version"])
        self.source.load_state(state["source"])
        self.coordinator.version = state["version"]
        # Groups consumed before the checkpoint count toward admission as in the original run.
        self.coordinator.counts.dispatched = self.coordinator.counts.consumed = (
            state["version"] * self.config.train.groups_per_step
        )
        self._step_counts = self.coordinator.snapshot()
        self._step_start = asyncio.get_running_loop().time()
        self.coordinator.notify()


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run, or None."""
    found = _checkpoints(run_dir / "checkpoints")
    return found[-1] if found else None


def _checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.iterdir()
        if p.name.startswith("step_")
        and p.name[5:].isdigit()
        and (p / "trainer_state.json").exists()
    ]
    return sorted(found, key=lambda p: int(p.name[5:]))


def _build_workflow(config: Config) -> Workflow:
    cls = import_object(config.workflow.cls, "workflow.cls")
    if not (isinstance(cls, type) and issubclass(cls, Workflow)):
        raise ConfigError(f"workflow.cls: {config.workflow.cls} is not a Workflow subclass")
    try:
        return cls(**config.workflow.args)
    except TypeError as e:
        raise ConfigError(f"workflow.args for {config.workflow.cls}: {e}") from None


def _write_config(config: Config, path: Path) -> None:
    from omegaconf import OmegaConf

    path.write_text(OmegaConf.to_yaml(config.model_dump(mode="json")))


def _first_error(group: BaseExceptionGroup) -> BaseException:
    """The root error of a failed scope, so that users see it rather than an ExceptionGroup."""
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return _first_error(exc)
        if not isinstance(exc, asyncio.CancelledError):
            return exc
    return group
