"""The TensorBoard sink: event files with every record's scalars, read back as TensorBoard does."""

from __future__ import annotations

import pytest

from rllm_async.metrics import TensorBoardSink
from rllm_async.trainer import UnifiedTrainer
from rllm_async.vclock import run
from tests.fakes import FakeBackend, ScriptedWorkflow, make_config, tasks

pytest.importorskip(
    "tensorboard", reason="an optional extra: pip install 'rllm-async[tensorboard]'"
)
from tensorboard.backend.event_processing.event_accumulator import (
    EventAccumulator,
)


def scalars(directory) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(directory))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def test_a_run_writes_its_records_as_tensorboard_scalars(tmp_path) -> None:
    cfg = make_config(tmp_path, train={"total_steps": 3}, logging={"tensorboard": True})
    trainer = UnifiedTrainer(
        cfg, backend=FakeBackend(), workflow=ScriptedWorkflow(), train_tasks=tasks(20)
    )
    records = run(trainer.fit(), virtual=True)
    assert list((cfg.run_path / "tensorboard").glob("events.out.tfevents.*"))
    written = scalars(cfg.run_path / "tensorboard")
    assert set(written) == {key for r in records for key in r} - {"step"}
    for key in ("reward/mean", "policy_version", "time/step_s"):
        steps, values = zip(*written[key], strict=True)  # TensorBoard keeps float32 values
        assert list(steps) == [r["step"] for r in records if key in r]
        assert list(values) == pytest.approx([r[key] for r in records if key in r], rel=1e-6)


def test_a_resumed_run_replaces_the_steps_after_its_checkpoint(tmp_path) -> None:
    first = TensorBoardSink(tmp_path)
    for step in (1, 2, 3):
        first.write({"step": step, "loss": float(step)})
    first.close()
    resumed = TensorBoardSink(tmp_path, initial_step=2)  # its checkpoint: step 2
    resumed.write({"step": 3, "loss": 30.0})
    resumed.close()
    assert scalars(tmp_path)["loss"] == [(1, 1.0), (2, 2.0), (3, 30.0)]
