"""UnifiedTrainer: one generation loop and one training loop under one structured-concurrency scope.

`UnifiedTrainer` holds what outlives one fit; `_Fit` is one `fit()`: its state and the training
loop, read top to bottom, beside the generation loop (`generation.py`). Everything they compose
(evaluation, checkpoints, health guards, the step record, the rollout runner) lives in modules of
its own, and `UnifiedTrainer._set_up` builds it all in one place as a fit starts. The file runs
past 400 lines so that the training loop reads in one place.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

from rllm_async import checkpoint
from rllm_async.accounting import Accounting
from rllm_async.algorithms.advantages import get_advantage_fn
from rllm_async.backends import get_backend_factory
from rllm_async.buffer import ReadyGroup, TrajectoryGroupBuffer
from rllm_async.callbacks import Callback
from rllm_async.checkpoint import CheckpointState
from rllm_async.concurrency_controller import starting_concurrency
from rllm_async.config import Config, ConfigError
from rllm_async.coordinator import GroupState, SyncCoordinator
from rllm_async.data import TaskSource, load_tasks
from rllm_async.evaluation import EvalSchedule, Evaluator
from rllm_async.generation import Generation
from rllm_async.metrics import Reduce
from rllm_async.plan.record import WorkloadRecorder
from rllm_async.protocols import Backend, PolicyClient, RecomputesLogprobs
from rllm_async.runner import build_workflow
from rllm_async.step_record import (
    EVALUATION,
    FORWARD_BACKWARD,
    OPTIM_STEP,
    WORKFLOW_STEP,
    StepMetrics,
    StepRecord,
)
from rllm_async.workflows.base import Workflow

log = logging.getLogger(__name__)


class UnifiedTrainer:
    """Trains `config.workflow` on `config.backend`, sync or async, with bounded staleness.

    The generation loop dispatches a task whenever the coordinator admits one and starts its
    `group_size` rollouts; the training loop streams ready groups into `forward_backward` every
    `micro_batch_groups` groups and steps the optimizer every `groups_per_step / mini_batches`
    groups (then passes over the batch again for each further epoch). `sync` mode is the same code
    with pipeline depth 0, no staleness and pinned weights.
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
        self.workflow = workflow if workflow is not None else build_workflow(config)
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
        if config.algorithm.loss.behaviour_logprobs == "recomputed" and not isinstance(
            backend, RecomputesLogprobs
        ):
            raise ConfigError(
                f"algorithm.loss.behaviour_logprobs: recomputed needs a backend that recomputes "
                f"old logprobs, and {type(backend).__name__} does not: set behaviour_logprobs: "
                "sampler, or use backend.name: local"
            )
        self.backend = backend
        self.max_concurrency = starting_concurrency(config, backend)
        self.coordinator = SyncCoordinator(
            config.coordinator,
            config.train.groups_per_step,
            backend.on_policy_updated,
            updates_per_batch=config.train.updates_per_batch,
        )
        self._ended: list[dict[str, float]] = []  # the records of the fits that ended
        self._fit: _Fit | None = None  # the running fit
        self.interrupted = False  # the last fit stopped at `interrupt()`
        self._stop: Callable[[], object] | None = None  # asks the running fit to stop

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

    def run(self) -> list[dict[str, float]]:
        """Run `fit()` to completion on a fresh event loop (a virtual clock for simulators)."""
        from rllm_async.vclock import run

        return run(self.fit(), virtual=self.virtual_clock)

    async def fit(self) -> list[dict[str, float]]:
        """Train until `train.total_steps` (or the end of the data, or `interrupt()`); returns the
        step records."""
        fit = self._fit = self._set_up()
        loop = asyncio.get_running_loop()
        self.interrupted = False
        try:
            await fit.start()
            async with asyncio.TaskGroup() as scope:
                generation = scope.create_task(fit.generation.run(), name="rllm-async:generation")
                training = scope.create_task(fit.train(generation), name="rllm-async:training")
                self._stop = lambda: loop.call_soon_threadsafe(fit.interrupt, training)
        except BaseExceptionGroup as group:
            raise _first_error(group) from None
        finally:
            self._stop = None
            try:
                await fit.close()
            finally:
                self._ended.extend(fit.record.records)
                self._fit = None
                self.interrupted = fit.interrupted
        return self.records

    @property
    def records(self) -> list[dict[str, float]]:
        """Every step record written so far: of the fits that ended, then of the running one."""
        running = self._fit.record.records if self._fit is not None else []
        return [*self._ended, *running]

    def interrupt(self) -> bool:
        """Stop the running fit as soon as it can: it writes a checkpoint of its last optimizer
        step (the tasks dispatched but not yet stepped on run first on resume) and returns its
        records, with `interrupted` set. Safe from a signal handler or another thread; False
        when no fit is training (not yet started, or done)."""
        stop = self._stop
        if stop is None:
            return False
        stop()
        return True

    def _set_up(self) -> _Fit:
        """Build every part of one fit, in one place: the run directory and its config.yaml, the
        buffer, the task source, evaluation, the checkpoint to resume from, the step record, the
        workload record and the generation loop."""
        cfg, coord, callbacks = self.config, self.coordinator, self.callbacks
        loop = asyncio.get_running_loop()
        now = loop.time()
        cfg.run_path.mkdir(parents=True, exist_ok=True)
        _write_config(cfg, cfg.run_path / "config.yaml")
        buffer = TrajectoryGroupBuffer.from_config(cfg, coord, self.advantage_fn)
        source = TaskSource.from_config(
            cfg,
            self.train_tasks,
            on_epoch_start=lambda epoch: _notify(callbacks, "on_epoch_start", epoch),
            on_epoch_end=lambda epoch: _notify(callbacks, "on_epoch_end", epoch),
        )
        policy = self.backend.policy()
        evaluator = Evaluator(cfg, self.workflow, self.eval_tasks, callbacks, self.max_concurrency)
        evals = EvalSchedule(evaluator, cfg, policy, coord.pause)
        resume_from = checkpoint.resume_path(cfg.checkpoint.resume, cfg.run_path)
        initial = checkpoint.read_state(resume_from).version if resume_from else 0
        record = StepRecord.from_config(cfg, coord.snapshot(), now, initial)
        meta = _workload_meta(cfg, self.virtual_clock, self.max_concurrency)
        workload = WorkloadRecorder(meta, clock=loop.time, start=now, seed=cfg.seed)
        reductions = self.workflow.metric_reductions
        accounting = Accounting(cfg, record, workload, source, reductions)
        generation = Generation(
            cfg, self.workflow, policy, coord, buffer, source, accounting, self.max_concurrency
        )
        return _Fit(
            cfg,
            self.workflow,
            self.backend,
            coord,
            callbacks,
            policy,
            buffer,
            source,
            evals,
            record,
            accounting,
            generation,
            resume_from,
            recorded=initial,
        )


@dataclass(eq=False)
class _Fit:
    """One call of `fit()`: the generation and training loops, and the state that lives as long
    as they do (the buffer, the data's position, the guards, the step record), all built by
    `_set_up` at its start."""

    config: Config
    workflow: Workflow
    backend: Backend
    coordinator: SyncCoordinator
    callbacks: list[Callback]
    policy: PolicyClient
    buffer: TrajectoryGroupBuffer
    source: TaskSource
    evals: EvalSchedule
    record: StepRecord
    accounting: Accounting
    generation: Generation
    resume_from: Path | None
    recorded: int  # the step of the last record (a batch's last version)
    checkpointed: int = -1
    interrupted: bool = False
    # Tasks of the groups taken for training since their last optimizer step, by dispatch id:
    # an interrupted step's, which its checkpoint serves again.
    unstepped: dict[int, dict[str, Any]] = field(default_factory=dict)

    async def start(self) -> None:
        """Start the workflow, resume from a checkpoint, and score the starting policy if asked
        (a record of step 0, outside the timed run)."""
        coord, loop = self.coordinator, asyncio.get_running_loop()
        await self.workflow.start(self.policy)
        if self.resume_from is not None:
            state = await checkpoint.load(self.resume_from, self.backend)
            self.source.load_state(state.source)
            coord.restore(state.version)
            self.record.next_step(loop.time(), coord.snapshot())
        for cb in self.callbacks:
            cb.on_train_start(coord.version)
        if self.config.eval.at_start and self.evals.enabled and coord.version == 0:
            self.record.add(await self.evals.evaluate(), EVALUATION)
            self.record.add({"time/elapsed_s": 0.0})  # the run's clock starts after it
            self.record.flush(0)
            self.record.restart_clock(loop.time())

    def interrupt(self, training: asyncio.Task[None]) -> None:
        """Stop training (and so generation) now; `close` writes the final checkpoint."""
        self.interrupted = True
        training.cancel()

    async def close(self) -> None:
        """Cancel what still runs (after the final checkpoint of an interrupted fit), record what
        ended since the last record, close the sinks, the workflow and the backend; the
        callbacks hear of the end."""
        coord = self.coordinator
        if self.interrupted:
            if coord.version != self.recorded:  # stepped, then interrupted before its record
                self._record_since(coord.version, always=True)
                self.recorded = coord.version
            await self._save_interrupted()
        self._cancel_outstanding()
        # A run that ended early (an error, an interrupt): what ended since its last record goes
        # in one more record of that step (inside a batch of several versions, not the versions
        # that a resume trains again).
        self._record_since(self.recorded)
        self.record.close()
        self.accounting.write_workload(self.config.run_path, coord.snapshot())
        try:
            try:
                await asyncio.wait_for(self.workflow.close(), timeout=30)
            finally:
                await asyncio.wait_for(self.backend.close(), timeout=30)
        finally:
            for cb in self.callbacks:
                cb.on_train_end(coord.version)

    # -- training ------------------------------------------------------------------------------

    async def train(self, generation: asyncio.Task[None]) -> None:
        """Take optimizer steps until `train.total_steps` or the end of the data."""
        try:
            # Evaluations run beside training (see EvalSchedule); this scope owns them.
            async with asyncio.TaskGroup() as evals:
                while self.coordinator.version < self.config.train.total_steps:
                    num_groups = await self._train_step()
                    if not num_groups:
                        await self._close_after_data_end()
                        break
                    await self._after_step(num_groups, generation, evals)
        finally:
            generation.cancel()

    async def _train_step(self) -> int:
        """Train one batch of `groups_per_step` groups in passes; the number of groups trained, 0
        when the data ran out. What the passes return goes into the step's record once, also
        when they stop early.

        1. The first pass takes the groups as they arrive, `groups_per_update` at a time (a
           mini-batch; verl's `ppo_mini_batch_size`), streaming each micro-batch into
           `forward_backward` and stepping the optimizer after each mini-batch. With recomputed
           old logprobs, the later mini-batches only have their old logprobs recomputed while
           they arrive, under the weights that sampled none of them yet: no step before the
           whole batch is in.
        2. With recomputed old logprobs: a step on the first mini-batch, then each later one
           trained and stepped.
        3. Each further epoch (`epochs_per_batch`; verl's `ppo_epochs`): every mini-batch again,
           trained and stepped.
        """
        tr = self.config.train
        recomputed = self.config.algorithm.loss.behaviour_logprobs == "recomputed"
        minis: list[list[ReadyGroup]] = []
        metrics = StepMetrics()
        try:
            for i in range(tr.mini_batches):
                consume = self._recompute_logprobs if recomputed and i else self._forward_backward
                mini, taken = await self._take(tr.groups_per_update, consume)
                metrics.extend(taken)
                if not mini:
                    break
                minis.append(mini)
                if not recomputed:
                    metrics.add(await self._optimizer_step(mini), OPTIM_STEP)
            if recomputed:
                for i, mini in enumerate(minis):
                    if i:
                        metrics.extend(await self._train_again(mini))
                    metrics.add(await self._optimizer_step(mini), OPTIM_STEP)
            for _ in range(1, tr.epochs_per_batch):
                for mini in minis:
                    metrics.extend(await self._train_again(mini))
                    metrics.add(await self._optimizer_step(mini), OPTIM_STEP)
        finally:
            self.record.add_step(metrics)
        return sum(len(mini) for mini in minis)

    async def _train_again(self, mini: list[ReadyGroup]) -> StepMetrics:
        """Forward-backward over a mini-batch taken before, a micro-batch at a time."""
        size = self.config.train.micro_batch_groups
        metrics = StepMetrics()
        for start in range(0, len(mini), size):
            metrics.add(await self._forward_backward(mini[start : start + size]), FORWARD_BACKWARD)
        return metrics

    async def _take(
        self, size: int, consume: Callable[[list[ReadyGroup]], Awaitable[dict[str, float]]]
    ) -> tuple[list[ReadyGroup], StepMetrics]:
        """Consume up to `size` groups, streaming micro-batches into `consume`; the groups (fewer
        when the data ran out) and the metrics of taking and consuming them, the seconds spent
        waiting for them among those when any came."""
        cfg, coord = self.config, self.coordinator
        loop = asyncio.get_running_loop()
        metrics = StepMetrics()
        taken: list[ReadyGroup] = []
        micro: list[ReadyGroup] = []
        idle = 0.0
        while len(taken) < size:
            t0 = loop.time()
            ready = await self.buffer.get()
            idle += loop.time() - t0
            if ready is None:
                break
            if coord.too_stale(ready.min_version):
                requeue = cfg.coordinator.stale_policy == "requeue"
                coord.move(GroupState.BUFFERED, GroupState.DROPPED_STALE, requeued=requeue)
                metrics.add({"tokens/wasted": ready.tokens})
                if requeue:
                    self.source.requeue(ready.dispatch.task)
                continue
            coord.move(GroupState.BUFFERED, GroupState.CONSUMED)
            metrics.add_consumed(ready, coord.staleness(ready.min_version))
            self.unstepped[ready.dispatch.id] = ready.dispatch.task
            taken.append(ready)
            micro.append(ready)
            if len(micro) == cfg.train.micro_batch_groups:
                metrics.add(await consume(micro), FORWARD_BACKWARD)
                micro = []
        if micro:
            metrics.add(await consume(micro), FORWARD_BACKWARD)
        if taken:
            metrics.add({"async/trainer_idle_s": idle})
        return taken, metrics

    async def _optimizer_step(self, stepped: list[ReadyGroup]) -> dict[str, float]:
        """Step the optimizer on the gradients of `stepped` (and earlier passes) and bump the
        version; the engine gets the new weights when a sync is due (see
        `SyncCoordinator.sync_due`) and after the last step. Returns the backend's metrics and
        the step's times."""
        coord = self.coordinator
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        metrics = await self.backend.optim_step()
        optim_s = loop.time() - t0
        for ready in stepped:
            self.unstepped.pop(ready.dispatch.id, None)
        version = coord.version + 1
        hook_s = sync_s = 0.0
        if coord.sync_due(version) or version >= self.config.train.total_steps:
            with self.accounting.training("sync"):
                hook_s, sync_s = await coord.update_policy(version)
        else:
            coord.advance(version)
        self.accounting.on_optimizer_step(version, loop.time(), optim_s, sync_s)
        sync = {"time/sync_s": sync_s, "time/sync_overhead_s": sync_s - hook_s}
        return {**metrics, "time/optim_step_s": optim_s, **sync}

    async def _forward_backward(self, micro: list[ReadyGroup]) -> dict[str, float]:
        """Accumulate the gradients of `micro`; the backend's metrics and the seconds it took."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        groups = [g for ready in micro for g in ready.groups]
        with self.accounting.training("train"):
            metrics = await self.backend.forward_backward(groups, self.config.algorithm.loss)
        seconds = loop.time() - t0
        self.accounting.on_forward_backward(sum(g.num_completion_tokens for g in groups), seconds)
        return {**metrics, "time/forward_backward_s": seconds}

    async def _recompute_logprobs(self, micro: list[ReadyGroup]) -> dict[str, float]:
        """Have the backend keep the current policy's logprobs of `micro` as their old ones."""
        assert isinstance(self.backend, RecomputesLogprobs)  # checked at construction
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await self.backend.recompute_logprobs([g for ready in micro for g in ready.groups])
        return {"time/recompute_logprobs_s": loop.time() - t0}

    async def _after_step(
        self, num_groups: int, generation: asyncio.Task[None], evals: asyncio.TaskGroup
    ) -> None:
        """Close the step: its record (with the evaluations due or finished), then the checkpoint
        when due. After the last step, generation stops first, so the record counts every group."""
        cfg, coord, record = self.config, self.coordinator, self.record
        loop = asyncio.get_running_loop()
        step = coord.version
        last = step >= cfg.train.total_steps or self.buffer.finished
        if last:
            generation.cancel()
            await asyncio.wait([generation])
            self._cancel_outstanding()
        counts = coord.snapshot()
        self._count_groups(counts)
        record.add(record.step_metrics(counts, loop.time(), coord.take_generation_idle()))
        record.add({"data/epoch": self.source.epoch, "train/groups": num_groups})
        workflow = self.workflow.step_metrics()
        record.add({f"workflow/{k}": v for k, v in workflow.items()}, WORKFLOW_STEP)
        finished = await self.evals.after_step(step, evals)
        if finished:
            record.add(finished[0], EVALUATION)
        if coord.controller is not None:
            record.add({"coordinator/pipeline_depth": coord.controller.depth})
        if self.generation.concurrency is not None:
            record.add({"rollout/max_concurrency": self.generation.concurrency.limit})
        flushed = record.flush(step)
        change = coord.observe_step(flushed)
        concurrency = self.generation.observe_step(flushed)
        self.recorded = step
        for cb in self.callbacks:
            cb.on_step_end(step, flushed)
        record.flush_evaluations(finished[1:], step, loop.time())  # those that finished together
        ck = cfg.checkpoint
        if (ck.every_steps and step % ck.every_steps == 0) or (last and ck.at_end):
            await self._save_checkpoint()
        record.next_step(loop.time())
        # Changes made after this step's record: the next one says why.
        for made in (change, concurrency):
            if made is not None:
                record.add(made.metrics(), "last")

    async def _close_after_data_end(self) -> None:
        """The data ran out after the last step's record was written: groups that ended since
        (filtered or failed), draws skipped since and an evaluation still running get one more
        record of that step, the final evaluation another; then the final checkpoint."""
        cfg, coord = self.config, self.coordinator
        version, loop = coord.version, asyncio.get_running_loop()
        if coord.synced_version != version:  # with sync_every > 1: the final weights, for eval
            await coord.update_policy(version)
        self._record_since(version, await self.evals.collect(wait=True))
        if cfg.eval.at_end and self.evals.enabled and self.evals.evaluated_version != version:
            self.record.flush_evaluations([await self.evals.evaluate()], version, loop.time())
        if cfg.checkpoint.at_end and self.checkpointed != version:
            await self._save_checkpoint()

    def _cancel_outstanding(self) -> None:
        """Cancel the groups still in flight or buffered; the tokens they generated are wasted."""
        if self.coordinator.outstanding:
            self.record.add({"tokens/wasted": self.buffer.cancel()})

    def _record_since(
        self, step: int, evaluations: list[dict[str, float]] | None = None, *, always: bool = False
    ) -> None:
        """What happened since the last record, as more records of `step`: one per finished
        evaluation, else one if groups ended or draws were skipped meanwhile (or `always`)."""
        now = asyncio.get_running_loop().time()
        ended = self._count_groups(self.coordinator.snapshot())
        if evaluations:
            self.record.flush_evaluations(evaluations, step, now)
        elif ended or always:
            self.record.flush_extra(step, now)

    def _count_groups(self, counts: dict[str, int]) -> bool:
        """Record how many groups ended each way, and how many draws were skipped as solved,
        since the last record; False if none did and none was."""
        ended = self.record.group_counts(counts)
        skipped = self.source.take_skipped()
        if self.config.algorithm.skip_solved:
            self.record.add({"data/skipped_solved": skipped})
        return ended or skipped > 0

    async def _save_interrupted(self) -> None:
        """The final checkpoint of an interrupted fit, of its last optimizer step; a backend that
        cannot write one now leaves the newest earlier checkpoint, and the log says why."""
        version = self.coordinator.version
        try:
            await self._save_checkpoint()
        except (RuntimeError, OSError) as e:
            log.warning("interrupted at step %d; no checkpoint of it was written: %s", version, e)
            return
        path = checkpoint.step_path(self.config.run_path, version)
        log.warning(
            "interrupted at step %d; checkpoint written to %s (checkpoint.resume: auto continues "
            "from it)",
            version,
            path,
        )

    async def _save_checkpoint(self) -> None:
        """Checkpoint the current version; the dispatches not yet trained are run again on resume."""
        version = self.coordinator.version

        def state() -> CheckpointState:
            pending = [*self.unstepped.values(), *(d.task for d in self.buffer.outstanding())]
            return CheckpointState(version, self.source.state(pending))

        keep_last = self.config.checkpoint.keep_last
        await checkpoint.save(self.config.run_path, self.backend, version, state, keep_last)
        self.checkpointed = version


def _workload_meta(config: Config, virtual_clock: bool, max_concurrency: int) -> dict[str, Any]:
    """The settings a recorded workload was run under, for `rllm-async plan` (`max_concurrency`:
    the rollout limit it started with, which `auto` moved from there)."""
    co, ro, tr = config.coordinator, config.rollout, config.train
    return {
        "backend": config.backend.name,
        "virtual_clock": virtual_clock,
        "mode": config.mode,
        "pipeline_depth": co.pipeline_depth,
        "max_staleness": co.max_staleness,
        "stale_policy": co.stale_policy,
        "weight_update": co.weight_update,
        "groups_per_step": tr.groups_per_step,
        "micro_batch_groups": tr.micro_batch_groups,
        "group_size": ro.group_size,
        "max_concurrency": max_concurrency,
        "late_concurrency": ro.late_concurrency,
        "max_tokens": ro.max_tokens,
    }


def _notify(callbacks: list[Callback], hook: str, epoch: int) -> None:
    """Call the epoch hook `hook` of every callback."""
    for cb in callbacks:
        getattr(cb, hook)(epoch)


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
