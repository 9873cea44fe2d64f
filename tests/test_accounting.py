"""`Accounting`: a group's outcome reaches the step record, the workload record, the task source and
the no-signal guard; a rollout's reaches the record and the failure-rate breaker."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rllm_async.accounting import Accounting, solved_metrics
from rllm_async.buffer import Dispatch, GroupOutcome
from rllm_async.coordinator import GroupState
from rllm_async.data import TaskSource
from rllm_async.health import FailureRateError
from rllm_async.metrics import MetricsAggregator
from rllm_async.plan.record import WorkloadRecorder
from rllm_async.runner import Rollout
from rllm_async.step_record import GROUP_COUNTS, StepRecord
from rllm_async.types import Episode, Step, Trajectory
from tests.fakes import make_config, tasks

COUNTS = {**dict.fromkeys(GROUP_COUNTS, 0), "in_flight": 0, "buffered": 0, "version": 0}


def _episode(correct: bool | None, tokens: int = 3) -> Episode:
    step = Step([1], [7] * tokens, [0.0] * tokens, [0] * tokens)
    return Episode("t0", [Trajectory([step], float(bool(correct)))], 0.0, is_correct=correct)


def _accounting(tmp_path: Path, **config: Any) -> tuple[Accounting, TaskSource]:
    config["rollout"] = {"group_size": 4, **config.get("rollout", {})}
    cfg = make_config(tmp_path, **config)
    source = TaskSource.from_config(cfg, tasks(4))
    clock = iter(range(1000)).__next__
    workload = WorkloadRecorder({}, clock=lambda: float(clock()), start=0.0)
    record = StepRecord(MetricsAggregator(), dict(COUNTS), 0.0)
    return Accounting(cfg, record, workload, source, {}), source


def test_solved_metrics_only_once_every_rollout_is_judged() -> None:
    judged_3 = [_episode(True)] * 3 + [_episode(None)]
    assert solved_metrics(GroupOutcome(GroupState.BUFFERED, judged_3), group_size=4) == {}
    mixed = [_episode(True), _episode(False)] * 2
    assert solved_metrics(GroupOutcome(GroupState.BUFFERED, mixed), 4) == {
        "groups/solve_all": 0.0,
        "groups/solve_none": 0.0,
    }
    right = GroupOutcome(GroupState.FILTERED, [_episode(True)] * 4)
    assert solved_metrics(right, 4)["groups/solve_all"] == 1.0
    wrong = GroupOutcome(GroupState.FILTERED, [_episode(False)] * 4)
    assert solved_metrics(wrong, 4)["groups/solve_none"] == 1.0


def test_a_filtered_groups_tokens_are_wasted_and_its_task_counts_as_solved(tmp_path) -> None:
    accounting, source = _accounting(tmp_path, algorithm={"skip_solved": True})
    kept = accounting.on_dispatch()
    dispatch = Dispatch(0, {"id": "t0"}, "t0", 0)
    episodes = [_episode(True, tokens=5)] * 4
    for episode in episodes:
        accounting.on_rollout(accounting.rollout_meter(kept), Rollout(episode))
    accounting.on_group(dispatch, kept, GroupOutcome(GroupState.FILTERED, episodes))
    record = accounting.record.flush(1)
    assert record["tokens/wasted"] == 20 and record["groups/solve_all"] == 1.0
    assert record["episode/correct"] == 1.0 and record["tokens/generated"] == 20
    assert kept is not None and kept.filtered is True and len(kept.done) == 4
    assert list(source.state([])["solved"].values()) == [[1, 1]], "skipped on its next draw"


def test_failed_rollouts_count_and_trip_the_breaker_past_its_rate(tmp_path) -> None:
    accounting, _ = _accounting(tmp_path, rollout={"failure_window": 4, "max_failure_rate": 0.5})
    meter = accounting.rollout_meter(None)
    accounting.on_rollout(meter, Rollout(_episode(True)))
    accounting.on_rollout(meter, Rollout(None, "ValueError: bad reply"))
    accounting.on_rollout(meter, Rollout(None, "ValueError: bad reply"))
    with pytest.raises(FailureRateError, match="bad reply"):
        accounting.on_rollout(meter, Rollout(None, "ValueError: bad reply"))
    assert accounting.record.flush(1)["rollout/failures"] == 3
