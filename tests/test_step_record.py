"""The step record on its own: declared reductions, metrics merged from a step's helpers, group
counts as changes, the closing figures of a step, and its sinks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rllm_async.buffer import Dispatch, ReadyGroup
from rllm_async.metrics import MetricsAggregator
from rllm_async.step_record import (
    FORWARD_BACKWARD,
    GROUP_COUNTS,
    OPTIM_STEP,
    StepMetrics,
    StepRecord,
    sinks,
)
from rllm_async.types import Episode, Step, Trajectory
from tests.fakes import make_config

COUNTS = {**dict.fromkeys(GROUP_COUNTS, 0), "in_flight": 0, "buffered": 0, "version": 0}


def _episode(reward: float, tokens: int = 3, correct: bool | None = None) -> Episode:
    step = Step([1], [7] * tokens, [0.0] * tokens, [0] * tokens)
    return Episode("t", [Trajectory([step], reward)], reward, is_correct=correct)


def _ready(*episodes: Episode) -> ReadyGroup:
    return ReadyGroup(Dispatch(0, {"id": "t"}, "t", 0), [], list(episodes), 0)


def _record(now: float = 0.0) -> StepRecord:
    return StepRecord(MetricsAggregator(), dict(COUNTS), now)


def test_step_metrics_keep_the_declared_reductions_and_reduce_a_backends_own_as_asked() -> None:
    metrics = StepMetrics()
    metrics.add({"loss": 2.0, "time/forward_backward_s": 1.5}, FORWARD_BACKWARD)
    metrics.add({"loss": 4.0, "time/forward_backward_s": 0.5}, FORWARD_BACKWARD)
    metrics.add({"lr": 0.1}, OPTIM_STEP)
    metrics.add({"lr": 0.2}, OPTIM_STEP)
    record = _record()
    record.add_step(metrics)
    out = record.flush(1)
    assert out["loss"] == 3.0, "a backend's forward-backward metrics: their mean"
    assert out["time/forward_backward_s"] == 2.0, "declared a sum, whatever the backend's is"
    assert out["lr"] == 0.2, "an optimizer step's: the last"


def test_a_metric_neither_declared_nor_given_a_reduction_is_refused() -> None:
    with pytest.raises(KeyError):
        StepMetrics().add({"undeclared/metric": 1.0})


def test_merged_metrics_reduce_as_if_each_value_were_added_as_it_happened() -> None:
    """Episodes of groups of different sizes: the mean over episodes, not over groups."""
    first, second = StepMetrics(), StepMetrics()
    first.add_consumed(_ready(_episode(1.0, correct=True)), staleness=0)
    second.add_consumed(
        _ready(_episode(0.0, correct=False), _episode(0.0), _episode(0.5, correct=False)),
        staleness=3,
    )
    first.extend(second)
    record = _record()
    record.add_step(first)
    out = record.flush(1)
    assert out["reward/mean"] == pytest.approx(1.5 / 4)
    assert out["train/correct"] == pytest.approx(1 / 3), "only the judged episodes"
    assert out["staleness/mean"] == 1.5 and out["staleness/max"] == 3


def test_the_correct_fraction_counts_every_scored_rollout_and_the_trained_ones_apart() -> None:
    """Two groups of four finish; the all-correct one is filtered (no reward variance), so only
    the half-correct one is trained. Hand count: 6 of 8 scored rollouts are correct, and 2 of
    the 4 trained ones; the unjudged rollout counts in neither."""
    solved = [_episode(1.0, correct=True) for _ in range(4)]
    half = [_episode(1.0, correct=True), _episode(1.0, correct=True)]
    half += [_episode(0.0, correct=False), _episode(0.0, correct=False)]
    record = _record()
    for episode in [*solved, *half, _episode(0.5)]:
        record.add_episode(episode, {})
    trained = StepMetrics()
    trained.add_consumed(_ready(*half), staleness=0)
    record.add_step(trained)
    out = record.flush(1)
    assert out["episode/correct"] == pytest.approx(6 / 8)
    assert out["train/correct"] == pytest.approx(2 / 4)
    assert out["rollout/reward/mean"] == pytest.approx(6.5 / 9)


def test_group_counts_are_the_changes_since_the_last_record() -> None:
    record = _record()
    assert not record.group_counts(dict(COUNTS)), "nothing ended"
    assert record.flush(0)["groups/consumed"] == 0
    assert record.group_counts({**COUNTS, "consumed": 3, "filtered": 1})
    assert record.group_counts({**COUNTS, "consumed": 5, "filtered": 1})
    out = record.flush(1)
    assert out["groups/consumed"] == 5 and out["groups/filtered"] == 1
    assert record.group_counts({**COUNTS, "consumed": 6, "filtered": 1})
    assert record.flush(2)["groups/consumed"] == 1


def test_step_metrics_are_rates_over_the_step_and_the_elapsed_time_of_the_fit() -> None:
    record = _record(now=10.0)
    record.add_episode(_episode(1.0, tokens=4), {})
    record.add_generation({"tokens/generated": 2})
    record.add({"async/trainer_idle_s": 1.0})
    counts = {**COUNTS, "in_flight": 7, "buffered": 2, "version": 3}
    out = record.step_metrics(counts, now=14.0, generation_idle_s=2.0)
    assert out["time/step_s"] == 4.0 and out["time/elapsed_s"] == 4.0
    assert out["episodes/per_s"] == 0.25 and out["tokens/per_s"] == 1.5
    assert out["async/trainer_idle_ratio"] == 0.25
    assert out["async/generation_idle_ratio"] == 0.5
    assert (out["groups/in_flight"], out["groups/buffered"], out["policy_version"]) == (7, 2, 3)
    record.next_step(14.0)
    out = record.step_metrics(counts, now=16.0, generation_idle_s=0.0)
    assert out["episodes/per_s"] == 0.0 and out["tokens/per_s"] == 0.0, "counted per step"
    assert out["time/step_s"] == 2.0 and out["time/elapsed_s"] == 6.0


def test_an_episodes_own_metrics_reduce_as_its_workflow_declares() -> None:
    record = _record()
    record.add_episode(
        Episode("t", [], 1.0, metrics={"turns": 2.0, "calls": 1.0}), {"calls": "sum"}
    )
    record.add_episode(
        Episode("t", [], 0.0, metrics={"turns": 4.0, "calls": 2.0}), {"calls": "sum"}
    )
    out = record.flush(1)
    assert out["episode/turns"] == 3.0 and out["episode/calls"] == 3.0
    assert out["rollout/reward/mean"] == 0.5


def test_every_flush_is_kept_and_an_extra_record_carries_the_elapsed_time() -> None:
    record = _record(now=1.0)
    records = record.records
    record.add({"tokens/wasted": 5})
    assert record.flush(2) == {"step": 2, "tokens/wasted": 5}
    record.add({"tokens/wasted": 1})
    record.flush_extra(2, now=4.0)
    assert records == [
        {"step": 2, "tokens/wasted": 5},
        {"step": 2, "time/elapsed_s": 3.0, "tokens/wasted": 1},
    ]


def test_the_record_of_a_config_writes_the_sinks_its_logging_asks(tmp_path: Path) -> None:
    config = make_config(tmp_path, logging={"progress_bar": False, "jsonl": True})
    assert [type(s).__name__ for s in sinks(config, 0)] == ["JsonlSink"]
    record = StepRecord.from_config(config, dict(COUNTS), now=0.0, initial_step=0)
    record.add({"tokens/wasted": 2})
    record.flush(1)
    record.close()
    lines = (config.run_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"step": 1, "tokens/wasted": 2}]


def test_evaluations_that_finish_late_are_one_more_record_of_the_step_each() -> None:
    record = _record(now=0.0)
    records = record.records
    record.flush(3)
    record.flush_evaluations([{"eval/n": 2.0}, {"eval/n": 5.0}], 3, now=2.0)
    assert records[1:] == [
        {"step": 3, "eval/n": 2.0, "time/elapsed_s": 2.0},
        {"step": 3, "eval/n": 5.0, "time/elapsed_s": 2.0},
    ]


def test_a_heartbeat_says_generation_goes_on_after_twice_a_steps_time_without_a_record(
    monkeypatch, caplog
) -> None:
    from rllm_async import step_record

    now = [0.0]
    monkeypatch.setattr(step_record.time, "monotonic", lambda: now[0])
    record = _record()
    record.flush(0)
    now[0] = 100.0
    record.flush(1)  # steps take 100 s: no record for 200 s is news, not 30
    caplog.set_level("INFO", logger="rllm_async")
    for t, correct in ((150.0, True), (250.0, False), (301.0, False)):
        now[0] = t
        record.add_episode(_episode(1.0 if correct else 0.0, correct=correct), {})
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == (
        "generating: 3 rollouts finished in the 201 s since the last record, mean reward "
        "0.333, 1 of 3 correct"
    )
