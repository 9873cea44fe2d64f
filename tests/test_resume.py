"""Checkpoint/resume: after a crash, every task is trained exactly once in the surviving lineage."""

from __future__ import annotations

import json
import random

import pytest

from rllm_async.trainer import UnifiedTrainer
from rllm_async.vclock import run
from tests.fakes import FakeBackend, ScriptedWorkflow, make_config, tasks


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_resume_trains_every_task_exactly_once(tmp_path, seed) -> None:
    rng = random.Random(seed)
    cfg = make_config(
        tmp_path,
        train={
            "total_steps": 100,
            "total_epochs": 1,
            "groups_per_step": 4,
            "micro_batch_groups": 2,
        },
        coordinator={"pipeline_depth": 2, "max_staleness": 2},
        checkpoint={"every_steps": 3, "resume": "auto", "at_end": True},
        algorithm={"filter_zero_variance": False},
    )
    latency = lambda: rng.expovariate(1.0)  # noqa: E731
    workflow = ScriptedWorkflow(reward=lambda t, i, a: float(i % 2))

    crashing = FakeBackend(latency=latency, fb_fault=lambda n: n == 2 * 7 + 1)  # inside step 8
    first = UnifiedTrainer(cfg, backend=crashing, workflow=workflow, train_tasks=tasks(40))
    with pytest.raises(RuntimeError, match="injected"):
        run(first.fit(), virtual=True)
    assert [p.name for p in sorted((cfg.run_path / "checkpoints").iterdir())] == [
        "step_3",
        "step_6",
    ]

    resumed_backend = FakeBackend(latency=latency)
    second = UnifiedTrainer(cfg, backend=resumed_backend, workflow=workflow, train_tasks=tasks(40))
    records = run(second.fit(), virtual=True)
    assert records[0]["step"] == 7
    assert resumed_backend.policy().version == records[-1]["step"] == 10

    kept = [tid for step in crashing.trained[:6] for tid, _ in step]
    redone = [tid for step in resumed_backend.trained for tid, _ in step]
    lineage = kept + redone
    assert sorted(lineage) == sorted(f"t{i}" for i in range(40)), "each task exactly once"
    assert len(set(lineage)) == len(lineage) == 40

    lines = (cfg.run_path / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines]
    assert steps[:7] == [1, 2, 3, 4, 5, 6, 7] and steps[-1] == 10


def test_resume_never_starts_fresh(tmp_path) -> None:
    cfg = make_config(tmp_path, checkpoint={"every_steps": 2, "resume": "never"})
    for _ in range(2):
        backend = FakeBackend()
        records = run(
            UnifiedTrainer(
                cfg, backend=backend, workflow=ScriptedWorkflow(), train_tasks=tasks(40)
            ).fit(),
            virtual=True,
        )
        assert records[0]["step"] == 1
