"""`Accounting`: where one fit's outcomes are recorded.

The generation loop reports each rollout and each group, the training loop each forward-backward
call and optimizer step; this one object hands them to those that keep account of them: the step
record (metrics), the workload record (for `rllm-async plan`), the health guards and the task
source. The loops only say what happened.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path

from rllm_async.buffer import Dispatch, GroupOutcome
from rllm_async.config import Config
from rllm_async.coordinator import GroupState
from rllm_async.data import TaskSource
from rllm_async.health import FailureRateBreaker, NoSignalGuard
from rllm_async.metrics import Reduce
from rllm_async.plan.record import KeptGroup, RolloutMeter, WorkloadRecorder
from rllm_async.runner import Rollout
from rllm_async.step_record import StepRecord


class Accounting:
    """Takes `on_dispatch`, `on_attempt`, `on_rollout` and `on_group` from generation, and
    `training`, `on_forward_backward` and `on_optimizer_step` from training."""

    def __init__(
        self,
        config: Config,
        record: StepRecord,
        workload: WorkloadRecorder,
        source: TaskSource,
        reductions: Mapping[str, Reduce],
    ) -> None:
        self.group_size = config.rollout.group_size
        self.record, self.workload, self.source = record, workload, source
        self.reductions = reductions  # the workflow's, for its episodes' own metrics
        self.breaker = FailureRateBreaker(config)
        self.no_signal = NoSignalGuard(config)

    # -- generation ------------------------------------------------------------------------------

    def on_dispatch(self) -> KeptGroup | None:
        """A group was dispatched; the workload record's group (None when it keeps none), to hand
        to `rollout_meter` and `on_group`."""
        return self.workload.group_started()

    def rollout_meter(self, kept: KeptGroup | None) -> RolloutMeter:
        """What a starting rollout's model calls report to (the engine's load)."""
        return self.workload.started(kept)

    def on_attempt(self, metrics: Mapping[str, float]) -> None:
        """A rollout attempt was retried or failed (`run_rollout`'s report)."""
        self.record.add_generation(metrics)

    def on_rollout(
        self, meter: RolloutMeter, rollout: Rollout, timing: Mapping[str, float] | None = None
    ) -> None:
        """A rollout ended: with an episode, or failed after its retries, for its infrastructure
        or not (which may trip the failure-rate breaker); `timing`: its seconds in model calls
        and in all (`ModelClock`), where `rollout.max_concurrency: auto` measures them."""
        if timing is not None:
            self.record.add(timing)
        episode = rollout.episode
        self.workload.finished(meter, episode)
        if episode is None:
            self.record.add_lost_rollout(rollout.infra_failed)
        else:
            self.record.add_episode(episode, self.reductions)
        self.breaker.observe(episode is None, rollout.last_error, rollout.infra_failed)

    def on_group(self, dispatch: Dispatch, kept: KeptGroup | None, outcome: GroupOutcome) -> None:
        """A group's rollouts all ended and the buffer took it, filtered it or failed it (a run of
        filtered groups may stop the run: `NoSignalGuard`)."""
        state = outcome.state
        self.record.add(solved_metrics(outcome, self.group_size))
        failed = state is GroupState.FAILED
        self.workload.group_ended(kept, None if failed else state is GroupState.FILTERED)
        self.source.group_ended(dispatch.task, solved=outcome.correct == self.group_size)
        if state in (GroupState.FILTERED, GroupState.FAILED):
            self.record.add({"tokens/wasted": outcome.tokens})
        if failed and outcome.infra_failed:
            self.record.add({"groups/failed_infra": 1})
        self.no_signal.observe(state)

    # -- training --------------------------------------------------------------------------------

    @contextlib.contextmanager
    def training(self, phase: str) -> Iterator[None]:
        """The learner is busy with `phase` ("train" or "sync") meanwhile, beside generation."""
        self.workload.phase(phase)
        try:
            yield
        finally:
            self.workload.phase(None)

    def on_forward_backward(self, tokens: int, seconds: float) -> None:
        """A forward-backward call of `tokens` completion tokens took `seconds`."""
        self.workload.trained(tokens, seconds)

    def on_optimizer_step(self, version: int, now: float, optim_s: float, sync_s: float) -> None:
        """The optimizer step to `version` ended `now` (its weight sync, if any, included)."""
        self.workload.step(version, now, optim_s, sync_s)

    def write_workload(self, run_path: Path, group_counts: dict[str, int]) -> None:
        """Write the workload record, with how the fit's groups ended, into `run_path`."""
        self.workload.meta["groups"] = group_counts
        self.workload.write(run_path)


def solved_metrics(outcome: GroupOutcome, group_size: int) -> dict[str, float]:
    """A group whose rollouts were all judged, as solved by all or by none: the groups that teach
    nothing, by kind, whether or not they are filtered."""
    if outcome.judged != group_size:
        return {}
    return {
        "groups/solve_all": float(outcome.correct == group_size),
        "groups/solve_none": float(outcome.correct == 0),
    }
