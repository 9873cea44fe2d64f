"""MetricsAggregator: explicit reductions, union of keys per step, JSONL sink."""

from __future__ import annotations

import json

import pytest

from rllm_async.metrics import JsonlSink, MetricsAggregator, ProgressBarSink


def test_each_reduction_is_the_declared_one() -> None:
    m = MetricsAggregator()
    for v in (1.0, 2.0, 6.0):
        m.record("a", v, "mean")
        m.record("b", v, "sum")
        m.record("c", v, "min")
        m.record("d", v, "max")
        m.record("e", v, "last")
    assert m.flush(1) == {"step": 1, "a": 3.0, "b": 9.0, "c": 1.0, "d": 6.0, "e": 6.0}


def test_record_is_the_union_of_keys_seen_in_the_step(tmp_path) -> None:
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    m = MetricsAggregator([sink])
    m.record("x", 1.0)
    m.record("loss/clip_frac", 0.5)  # a name must not decide its reduction
    m.record("loss/clip_frac", 0.1)
    m.flush(1)
    m.record("y", 2.0, "sum")
    m.flush(2)
    m.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0] == {"step": 1, "x": 1.0, "loss/clip_frac": pytest.approx(0.3)}
    assert rows[1] == {"step": 2, "y": 2.0}


def test_a_key_keeps_its_declared_reduction() -> None:
    m = MetricsAggregator()
    m.record("k", 1.0, "sum")
    with pytest.raises(ValueError, match="declared with reduction 'sum', now 'mean'"):
        m.record("k", 1.0, "mean")
    m.flush(1)
    with pytest.raises(ValueError, match="declared with reduction 'sum'"):
        m.record("k", 1.0, "max")
    with pytest.raises(ValueError, match="unknown reduction"):
        m.record("z", 1.0, "median")  # type: ignore[arg-type]


def test_trainer_records_have_the_documented_keys(tmp_path) -> None:
    from rllm_async.trainer import UnifiedTrainer
    from rllm_async.vclock import run
    from tests.fakes import FakeBackend, ScriptedWorkflow, make_config, tasks

    cfg = make_config(tmp_path)
    run(
        UnifiedTrainer(
            cfg,
            backend=FakeBackend(latency=lambda: 0.5),
            workflow=ScriptedWorkflow(),
            train_tasks=tasks(40),
        ).fit(),
        virtual=True,
    )
    rows = [json.loads(line) for line in (cfg.run_path / "metrics.jsonl").read_text().splitlines()]
    required = {
        "step",
        "policy_version",
        "reward/mean",
        "staleness/mean",
        "staleness/max",
        "time/step_s",
        "async/trainer_idle_ratio",
        "async/generation_idle_ratio",
        "groups/consumed",
        "groups/filtered",
        "groups/failed",
        "groups/dropped_stale",
        "groups/requeued",
        "episodes/per_s",
        "tokens/per_s",
    }
    assert len(rows) == 5
    for row in rows:
        assert required <= row.keys(), required - row.keys()
        assert 0.0 <= row["async/trainer_idle_ratio"] <= 1.0
        assert 0.0 <= row["async/generation_idle_ratio"] <= 1.0


def test_progress_bar_shows_held_out_accuracy_where_the_task_judges_it(capsys) -> None:
    bar = ProgressBarSink(total=4)
    bar.write({"step": 1.0, "reward/mean": 0.25, "staleness/mean": 1.0})
    bar.write({"step": 2.0, "eval/reward/mean": 0.559, "eval/accuracy": 0.51})
    bar.close()
    final = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert "eval=0.51" in final and "0.559" not in final
    unjudged = ProgressBarSink(total=4)  # a task without a correctness judge: held-out reward
    unjudged.write({"step": 1.0, "eval/reward/mean": 0.559})
    unjudged.close()
    assert "eval=0.559" in capsys.readouterr().err
