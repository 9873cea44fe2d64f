"""What a run reports: episode metrics, every generated group counted once, runs without signal."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest

from rllm_async.backends.sim import workload_config
from rllm_async.config import ConfigError
from rllm_async.health import FailureRateError, NoSignalError
from rllm_async.rollout import RolloutContext
from rllm_async.trainer import UnifiedTrainer
from rllm_async.types import Episode
from rllm_async.vclock import run
from rllm_async.workflows.base import Workflow
from tests.fakes import FakeBackend, ScriptedWorkflow, make_config, tasks

GROUP_ENDS = ("consumed", "filtered", "failed", "dropped_stale", "cancelled")


class ReportingWorkflow(Workflow):
    """Reports `calls` (declared a sum), `index` (a mean), and `first` from rollout 0 only."""

    metric_reductions = {"calls": "sum"}  # noqa: RUF012

    def __init__(self) -> None:
        self.finished = 0

    async def run(self, task: dict[str, Any], ctx: RolloutContext) -> Episode:
        await ctx.generate([1, 2])
        episode = ctx.build_episode(float(ctx.rollout_index % 2))
        episode.metrics.update(calls=1, index=float(ctx.rollout_index))
        if ctx.rollout_index == 0:
            episode.metrics["first"] = 7.0
        self.finished += 1
        return episode


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_episode_metrics_reach_every_record_with_the_union_of_keys(tmp_path, mode) -> None:
    workflow = ReportingWorkflow()
    cfg = make_config(tmp_path, mode=mode, eval={"every_steps": 0, "at_end": True})
    trainer = UnifiedTrainer(
        cfg,
        backend=FakeBackend(latency=lambda: 1.0),
        workflow=workflow,
        train_tasks=tasks(30),
        eval_tasks=tasks(5),
    )
    records = run(trainer.fit(), virtual=True)
    assert len(records) == 5
    # `first`, reported by a quarter of the episodes only, is in the records beside the others.
    with_first = [r for r in records if "episode/first" in r]
    assert with_first and all(r["episode/first"] == 7.0 for r in with_first)
    assert all(0.0 <= r["episode/index"] <= 3.0 for r in with_first)
    if mode == "sync":  # each step has every rollout of its four groups, and only those
        assert with_first == records
        assert all(r["episode/calls"] == 16 and r["episode/index"] == 1.5 for r in records)
    # Every episode that finished is in some record, the ones cancelled at the end included.
    assert sum(r.get("episode/calls", 0) for r in records) == workflow.finished - 5  # not eval
    last = records[-1]
    assert (last["eval/episode/calls"], last["eval/episode/first"]) == (5.0, 7.0)
    lines = (cfg.run_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == len(records) and '"episode/first": 7.0' in lines[0]


class BadMetricWorkflow(Workflow):
    async def run(self, task: dict[str, Any], ctx: RolloutContext) -> Episode:
        await ctx.generate([1])
        episode = ctx.build_episode(1.0)
        episode.metrics["answer"] = "forty-two"  # type: ignore[assignment]
        return episode


def test_a_metric_that_is_not_a_number_fails_the_rollout_with_its_key(tmp_path) -> None:
    trainer = UnifiedTrainer(
        make_config(tmp_path),
        backend=FakeBackend(),
        workflow=BadMetricWorkflow(),
        train_tasks=tasks(30),
    )
    with pytest.raises(FailureRateError, match=r"Episode.metrics\['answer'\] is 'forty-two'"):
        run(trainer.fit(), virtual=True)


def test_an_unknown_reduction_is_refused_before_the_run(tmp_path) -> None:
    class Median(ReportingWorkflow):
        metric_reductions = {"calls": "median"}  # type: ignore[dict-item]  # noqa: RUF012

    with pytest.raises(ConfigError, match=r"Median.metric_reductions\['calls'\] is 'median'"):
        UnifiedTrainer(
            make_config(tmp_path), backend=FakeBackend(), workflow=Median(), train_tasks=tasks(4)
        )


def group_totals(records: list[dict[str, float]]) -> dict[str, float]:
    keys = ("dispatched", *GROUP_ENDS)
    return {key: sum(r.get(f"groups/{key}", 0.0) for r in records) for key in keys}


def test_every_generated_group_is_counted_once_over_a_whole_run(tmp_path: Path) -> None:
    # Faults of every kind on the simulator: workflow errors and hangs, failed syncs, stale groups
    # requeued, zero-variance groups filtered, and groups still in flight at the last step.
    cfg = workload_config(
        "W4",
        [
            f"run_dir={tmp_path}",
            "logging.progress_bar=false",
            "checkpoint.at_end=false",
            "train.total_steps=12",
            "train.groups_per_step=8",
            "coordinator.pipeline_depth=2",
            "coordinator.max_staleness=2",
            "workflow.args.exception_rate=0.3",
            "workflow.args.hang_rate=0.05",
            "rollout.timeout_s=300",
            "rollout.retries=0",
            "rollout.min_group_size=6",
            "rollout.max_failure_rate=1.0",
            "backend.sync_fail_every=5",
        ],
    )
    records = UnifiedTrainer(cfg).run()
    assert [r["step"] for r in records] == list(range(1, 13))
    totals = group_totals(records)
    for key in GROUP_ENDS:
        assert totals[key] > 0, f"the run ended no group as {key}: it tests too little"
    assert totals["dispatched"] == sum(totals[key] for key in GROUP_ENDS)
    assert records[-1]["groups/cancelled"] == totals["cancelled"]


def test_a_run_that_stops_on_an_error_still_counts_every_group(tmp_path: Path) -> None:
    # From the third task on, every rollout fails: the breaker stops the run mid-step.
    fault = lambda task, i, a: "raise" if int(task["id"][1:]) >= 2 else None  # noqa: E731
    cfg = make_config(tmp_path, rollout={"max_failure_rate": 0.5, "retries": 0})
    trainer = UnifiedTrainer(
        cfg,
        backend=FakeBackend(latency=lambda: 1.0),
        workflow=ScriptedWorkflow(fault=fault),
        train_tasks=tasks(40),
    )
    with pytest.raises(FailureRateError):
        run(trainer.fit(), virtual=True)
    totals = group_totals(trainer.records)
    assert totals["failed"] > 0 and totals["cancelled"] > 0
    assert totals["dispatched"] == sum(totals[key] for key in GROUP_ENDS)


def test_a_run_without_signal_warns_early_then_stops_at_its_bound(tmp_path, caplog) -> None:
    # Every rollout gets the same reward: every group is filtered, no step is ever taken.
    cfg = make_config(
        tmp_path,
        logging={"progress_bar": True},
        algorithm={"no_signal_steps": 5},
        train={"groups_per_step": 4},
    )
    trainer = UnifiedTrainer(
        cfg,
        backend=FakeBackend(latency=lambda: 1.0),
        workflow=ScriptedWorkflow(reward=lambda task, i, a: 0.0),
        train_tasks=tasks(1000),
    )
    with pytest.raises(NoSignalError, match=r"the last 20 groups .*no_signal_steps=5"):
        run(trainer.fit(), virtual=True)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, "one warning per streak of filtered groups"
    assert re.match(
        r"the last 12 groups all had equal rewards .*filter_zero_variance=false; the run stops "
        r"at 20 in a row \(algorithm.no_signal_steps=5\)",
        warnings[0].getMessage(),
    )
    assert 20 <= trainer.coordinator.counts.filtered < 30  # groups that ended at the same time


def test_the_no_signal_warning_prints_above_the_progress_bar(tmp_path, capsys) -> None:
    cfg = make_config(
        tmp_path,
        logging={"progress_bar": True},
        algorithm={"no_signal_steps": None},
        train={"total_epochs": 1, "groups_per_step": 4},
    )
    trainer = UnifiedTrainer(
        cfg,
        backend=FakeBackend(latency=lambda: 1.0),
        workflow=ScriptedWorkflow(reward=lambda task, i, a: 0.0),
        train_tasks=tasks(30),
    )
    records = run(trainer.fit(), virtual=True)
    assert [(r["step"], r["groups/filtered"]) for r in records] == [(0, 30)]  # no step taken
    err = capsys.readouterr().err
    assert "WARNING: the last 12 groups all had equal rewards" in err
    assert "algorithm.no_signal_steps is null, so the run goes on" in err
    assert "warning: no signal" in err  # the bar's postfix
    assert not logging.getLogger("rllm_async").handlers, "the bar's log handler is removed"
