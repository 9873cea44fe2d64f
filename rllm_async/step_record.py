"""The per-step record: every metric's reduction, declared here, and the record one fit assembles
per optimizer step from the metrics its steps and helpers return."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from rllm_async.buffer import ReadyGroup
from rllm_async.config import Config
from rllm_async.metrics import (
    JsonlSink,
    MetricsAggregator,
    MetricsSink,
    ProgressBarSink,
    Reduce,
    TensorBoardSink,
    WandbSink,
)
from rllm_async.types import Episode

log = logging.getLogger(__name__)
# Seconds without a record after which a finished rollout logs that generation goes on (at least
# twice the time between the last two records, so that a run whose steps are slow stays quiet).
HEARTBEAT_S = 30.0

# How each metric the trainer records is reduced over a step.
REDUCTIONS: dict[str, Reduce] = {
    # each rollout
    "rollout/retries": "sum",
    "rollout/timeouts": "sum",
    "rollout/errors": "sum",
    "rollout/failures": "sum",
    "rollout/infra_errors": "sum",
    "rollout/infra_failed": "sum",
    "rollout/infra_failed_frac": "last",  # of the rollouts that ended in the record
    "rollout/reward/mean": "mean",
    "episode/completion_tokens": "mean",
    "episode/correct": "mean",
    "tokens/generated": "sum",
    "tokens/wasted": "sum",
    "rollout/model_s": "sum",  # rollout.max_concurrency: auto
    "rollout/wall_s": "sum",
    # each completed or ended group
    "groups/solve_all": "sum",
    "groups/solve_none": "sum",
    "groups/dispatched": "sum",
    "groups/consumed": "sum",
    "groups/filtered": "sum",
    "groups/failed": "sum",
    "groups/failed_infra": "sum",
    "groups/dropped_stale": "sum",
    "groups/cancelled": "sum",
    "groups/requeued": "sum",
    "data/skipped_solved": "sum",
    # each trained group and each update
    "reward/mean": "mean",
    "train/correct": "mean",
    "staleness/mean": "mean",
    "staleness/max": "max",
    "time/forward_backward_s": "sum",
    "time/recompute_logprobs_s": "sum",
    "time/optim_step_s": "sum",
    "time/sync_s": "sum",
    "time/sync_overhead_s": "sum",
    "async/trainer_idle_s": "sum",
    # once per step
    "groups/in_flight": "last",
    "groups/buffered": "last",
    "policy_version": "last",
    "time/step_s": "last",
    "time/elapsed_s": "last",
    "async/trainer_idle_ratio": "last",
    "async/generation_idle_ratio": "last",
    "episodes/per_s": "last",
    "tokens/per_s": "last",
    "data/epoch": "last",
    "train/groups": "last",
    "coordinator/pipeline_depth": "last",  # pipeline_depth: auto
    "rollout/max_concurrency": "last",  # rollout.max_concurrency: auto
}
# Metrics whose names the backend or the evaluation choose, reduced as a whole.
FORWARD_BACKWARD: Reduce = "mean"  # a backend's, once per micro-batch
OPTIM_STEP: Reduce = "last"  # a backend's, once per step
EVALUATION: Reduce = "last"  # `eval/*`, once per evaluation
WORKFLOW_STEP: Reduce = "last"  # a workflow's `step_metrics()`, `workflow/*`, once per step

# Group outcomes counted per record, as the change since the previous record.
GROUP_COUNTS = (
    "dispatched",
    "consumed",
    "filtered",
    "failed",
    "dropped_stale",
    "cancelled",
    "requeued",
)


def record_episode(
    metrics: MetricsAggregator, prefix: str, episode: Episode, reductions: Mapping[str, Reduce]
) -> None:
    """An episode's own metrics, reduced as its workflow declares (mean by default)."""
    for key, value in episode.metrics.items():
        metrics.record(prefix + key, value, reductions.get(key, "mean"))


class StepMetrics:
    """The metrics that one training step's helpers return, merged in order, each with its
    reduction, so that the step's record takes them at once and reduces them exactly as if each
    had been added as it happened."""

    def __init__(self) -> None:
        self.values: list[tuple[str, float, Reduce]] = []

    def add(self, metrics: Mapping[str, float], own: Reduce | None = None) -> None:
        """Merge `metrics`, each reduced as `REDUCTIONS` declares; `own`: how the keys it does not
        declare (a backend's own) are reduced."""
        for key, value in metrics.items():
            reduce = own if own is not None and key not in REDUCTIONS else REDUCTIONS[key]
            self.values.append((key, value, reduce))

    def add_consumed(self, ready: ReadyGroup, staleness: int) -> None:
        """A group taken for training: each episode's reward and correctness (`train/correct`:
        the trained rollouts alone, which filtering biases), and the group's staleness."""
        for episode in ready.episodes:
            self.values.append(("reward/mean", episode.reward, REDUCTIONS["reward/mean"]))
            if episode.is_correct is not None:
                correct = float(episode.is_correct)
                self.values.append(("train/correct", correct, REDUCTIONS["train/correct"]))
        self.add({"staleness/mean": staleness, "staleness/max": staleness})

    def extend(self, other: StepMetrics) -> None:
        """Merge what `other` holds, after what this holds."""
        self.values.extend(other.values)


class StepRecord:
    """One fit's step records: collects what happens during a step and, once per step, reduces it
    into one record for every sink. Also counts the step's episodes and tokens and its time."""

    @classmethod
    def from_config(
        cls, config: Config, counts: dict[str, int], now: float, initial_step: int
    ) -> StepRecord:
        """The record of a fit of `config`, its sinks as `logging:` asks (see `sinks`)."""
        return cls(MetricsAggregator(sinks(config, initial_step)), counts, now)

    def __init__(self, metrics: MetricsAggregator, counts: dict[str, int], now: float) -> None:
        self.metrics = metrics
        self.records: list[dict[str, float]] = []  # every record written, in order
        self.fit_start = self.step_start = now
        self._counts = counts  # the coordinator's counts at the previous record
        self._episodes = 0
        self._tokens = 0
        # Finished episodes not yet in `metrics`: how many, their rewards' and tokens' sums, and
        # how many were judged and judged correct.
        self._pending_episodes = 0
        self._pending_reward = 0.0
        self._pending_tokens = 0
        self._pending_judged = 0
        self._pending_correct = 0
        # Rollouts that ended without an episode since the last record, and of them those that
        # failed for their infrastructure.
        self._pending_lost = 0
        self._pending_infra = 0
        # When the last record was written and the last heartbeat logged (wall-clock seconds), and
        # how long without a record is news.
        self._recorded_at = self._heard = time.monotonic()
        self._quiet_s = HEARTBEAT_S

    def add(self, metrics: Mapping[str, float], reduce: Reduce | None = None) -> None:
        """Add metrics to the step's record, each reduced as `REDUCTIONS` declares (or `reduce`)."""
        for key, value in metrics.items():
            self.metrics.record(key, value, reduce or REDUCTIONS[key])

    def add_generation(self, metrics: Mapping[str, float]) -> None:
        """Add the metrics of a rollout attempt, counting its tokens toward `tokens/per_s`."""
        self.add(metrics)
        self._tokens += int(metrics.get("tokens/generated", 0))

    def add_lost_rollout(self, infra_failed: bool) -> None:
        """A rollout ended without an episode: every attempt failed (`rollout/failures`), the last
        for its infrastructure when `infra_failed` (`rollout/infra_failed`)."""
        self._pending_lost += 1
        if infra_failed:
            self._pending_infra += 1
            self.add({"rollout/infra_failed": 1})
        else:
            self.add({"rollout/failures": 1})

    def add_episode(self, episode: Episode, reductions: Mapping[str, Reduce]) -> None:
        """A finished episode's metrics (reward, completion tokens, and correctness where judged:
        every scored rollout counts, trained or filtered), its own reduced as its workflow's
        `reductions` declare."""
        tokens = episode.num_completion_tokens
        self._pending_episodes += 1
        self._pending_reward += float(episode.reward)
        self._pending_tokens += tokens
        if episode.is_correct is not None:
            self._pending_judged += 1
            self._pending_correct += episode.is_correct
        self._tokens += tokens
        if episode.metrics:
            record_episode(self.metrics, "episode/", episode, reductions)
        self._episodes += 1
        now = time.monotonic()
        if now - self._heard >= self._quiet_s:
            self._heartbeat(now)

    def _heartbeat(self, now: float) -> None:
        """Say that generation goes on while no step is recorded (a task the policy cannot yet
        do: every group filtered), with what the rollouts since the last record scored."""
        n, judged = self._pending_episodes, self._pending_judged
        correct = f", {self._pending_correct} of {judged} correct" if judged else ""
        log.info(
            "generating: %d rollouts finished in the %.0f s since the last record, mean reward "
            "%.3g%s",
            n,
            now - self._recorded_at,
            self._pending_reward / n,
            correct,
        )
        self._heard = now

    def add_step(self, metrics: StepMetrics) -> None:
        """Add what a training step's helpers returned, in the order they returned it."""
        for key, value, reduce in metrics.values:
            self.metrics.record(key, value, reduce)

    def group_counts(self, counts: dict[str, int]) -> bool:
        """Add how many groups ended each way since the last record; False if none did."""
        changes = {key: counts[key] - self._counts[key] for key in GROUP_COUNTS}
        self.add({f"groups/{key}": n for key, n in changes.items()})
        self._counts = counts
        return any(changes.values())

    def step_metrics(
        self, counts: dict[str, int], now: float, generation_idle_s: float
    ) -> dict[str, float]:
        """The closing figures of the step that ends `now`: timing, rates, where groups are."""
        step_s = max(now - self.step_start, 1e-12)
        trainer_idle_s = self.metrics.peek("async/trainer_idle_s") or 0.0
        return {
            "groups/in_flight": counts["in_flight"],
            "groups/buffered": counts["buffered"],
            "policy_version": counts["version"],
            "time/step_s": step_s,
            "time/elapsed_s": now - self.fit_start,
            "async/trainer_idle_ratio": trainer_idle_s / step_s,
            "async/generation_idle_ratio": generation_idle_s / step_s,
            "episodes/per_s": self._episodes / step_s,
            "tokens/per_s": self._tokens / step_s,
        }

    def flush(self, step: int) -> dict[str, float]:
        """Write the record of `step` to every sink."""
        episodes, reward, tokens = (
            self._pending_episodes,
            self._pending_reward,
            self._pending_tokens,
        )
        ended = episodes + self._pending_lost
        if ended:
            infra_frac = self._pending_infra / ended
            self.add({"rollout/infra_failed_frac": infra_frac})
            self._pending_lost = self._pending_infra = 0
        if episodes:
            record_total = self.metrics.record_total
            record_total("rollout/reward/mean", reward, episodes, REDUCTIONS["rollout/reward/mean"])
            record_total(
                "episode/completion_tokens",
                tokens,
                episodes,
                REDUCTIONS["episode/completion_tokens"],
            )
            record_total("tokens/generated", tokens, episodes, REDUCTIONS["tokens/generated"])
            self._pending_episodes, self._pending_reward, self._pending_tokens = 0, 0.0, 0
        if self._pending_judged:
            self.metrics.record_total(
                "episode/correct",
                self._pending_correct,
                self._pending_judged,
                REDUCTIONS["episode/correct"],
            )
            self._pending_judged = self._pending_correct = 0
        record = self.metrics.flush(step)
        now = time.monotonic()
        self._quiet_s = max(HEARTBEAT_S, 2 * (now - self._recorded_at))
        self._recorded_at = self._heard = now
        self.records.append(record)
        return record

    def flush_extra(self, step: int, now: float) -> None:
        """One more record of `step`, for what ended after its record was written."""
        self.add({"time/elapsed_s": now - self.fit_start})
        self.flush(step)

    def flush_evaluations(self, evaluations: list[dict[str, float]], step: int, now: float) -> None:
        """One more record of `step` for each evaluation that finished after its record."""
        for evaluation in evaluations:
            self.add(evaluation, EVALUATION)
            self.flush_extra(step, now)

    def next_step(self, now: float, counts: dict[str, int] | None = None) -> None:
        """The next step starts `now`; `counts`: the coordinator's counts to count changes from."""
        self.step_start = now
        self._episodes = self._tokens = 0
        if counts is not None:
            self._counts = counts

    def restart_clock(self, now: float) -> None:
        """The run's clock starts `now` (after an evaluation of the starting policy)."""
        self.fit_start = self.step_start = now

    def close(self) -> None:
        self.metrics.close()


def sinks(cfg: Config, initial_step: int) -> list[MetricsSink]:
    """Where a run's records go, as `logging:` asks; `initial_step` > 0: a run resumed from the
    checkpoint of that step."""
    sinks: list[MetricsSink] = []
    if cfg.logging.jsonl:
        sinks.append(JsonlSink(cfg.run_path / "metrics.jsonl"))
    if cfg.logging.progress_bar:
        sinks.append(ProgressBarSink(cfg.train.total_steps, initial=initial_step, desc=cfg.name))
    if cfg.logging.tensorboard:
        sinks.append(TensorBoardSink(cfg.run_path / "tensorboard", initial_step))
    if cfg.logging.wandb.enabled:
        config = cfg.model_dump(mode="json")
        resume = initial_step > 0
        sinks.append(WandbSink(cfg.logging.wandb, cfg.name, config, cfg.run_path, resume))
    return sinks
