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


@pytest.mark.parametrize(("mini_batches", "epochs"), [(2, 2), (1, 3)])
def test_resume_with_several_optimizer_steps_per_batch(tmp_path, mini_batches, epochs) -> None:
    per = mini_batches * epochs  # optimizer steps (versions) per batch
    rng = random.Random(7)
    cfg = make_config(
        tmp_path,
        train={
            "total_steps": 12 * per,
            "total_epochs": 1,
            "groups_per_step": 4,
            "micro_batch_groups": 2,
            "mini_batches": mini_batches,
            "epochs_per_batch": epochs,
        },
        coordinator={"pipeline_depth": 1, "max_staleness": per},
        checkpoint={"every_steps": 2 * per, "resume": "auto", "at_end": True},
        algorithm={"filter_zero_variance": False},
    )
    latency = lambda: rng.expovariate(1.0)  # noqa: E731
    workflow = ScriptedWorkflow(reward=lambda t, i, a: float(i % 2))
    # forward_backward calls per batch: two micro-batches for each of its `epochs` passes; the
    # crash comes inside the fifth batch, after its first optimizer step and the fourth's checkpoint.
    calls = 2 * epochs
    crashing = FakeBackend(latency=latency, fb_fault=lambda n: n == 4 * calls + 3)
    first = UnifiedTrainer(cfg, backend=crashing, workflow=workflow, train_tasks=tasks(40))
    with pytest.raises(RuntimeError, match="injected"):
        run(first.fit(), virtual=True)
    assert 4 * per < first.coordinator.version < 5 * per, "it crashed inside a batch"
    checkpoints = {p.name for p in (cfg.run_path / "checkpoints").iterdir()}
    assert checkpoints == {f"step_{2 * per}", f"step_{4 * per}"}

    resumed_backend = FakeBackend(latency=latency)
    second = UnifiedTrainer(cfg, backend=resumed_backend, workflow=workflow, train_tasks=tasks(40))
    records = run(second.fit(), virtual=True)
    # Versions continue from the checkpoint, one record per batch at its last version, and the
    # run ends with the data: 40 tasks are 10 batches.
    assert [r["step"] for r in records] == [per * b for b in range(5, 11)]
    assert second.coordinator.version == resumed_backend.policy().version == 10 * per
    assert len(resumed_backend.trained) == 6 * per

    def batches(steps: list) -> list[set[str]]:
        """The tasks of each batch; every pass over a batch trains the same groups."""
        out = []
        for b in range(0, len(steps), per):
            passes = [
                steps[b + e * mini_batches : b + (e + 1) * mini_batches] for e in range(epochs)
            ]
            assert all(p == passes[0] for p in passes)
            out.append({tid for step in passes[0] for tid, _ in step})
        return out

    lineage = batches(crashing.trained[: 4 * per]) + batches(resumed_backend.trained)
    assert all(len(b) == 4 for b in lineage)
    assert sorted(t for b in lineage for t in b) == sorted(f"t{i}" for i in range(40))
    # Staleness is counted from each batch's first version, within the bound after the resume
    # as before it, and the resumed counts start from the checkpoint's batches.
    assert all(r["staleness/max"] <= per for r in records)
    counts = second.coordinator.counts
    assert counts.consumed == 40
    assert counts.dispatched - 4 * 4 == sum(r["groups/dispatched"] for r in records)
    assert counts.dispatched == counts.consumed + counts.dropped_stale + counts.cancelled

    # Every record, the crashed attempt's included, is of a batch's last version: what ended after
    # the crash is one more record of the last batch recorded, not of a version trained again.
    lines = (cfg.run_path / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines]
    assert sorted(set(steps)) == [per * b for b in range(1, 11)], steps


def test_an_interrupt_mid_step_checkpoints_its_last_step_and_resume_trains_every_task_once(
    tmp_path,
) -> None:
    """`interrupt()` inside step 8, its first micro-batch trained and not yet stepped on: the
    fit writes step 7's checkpoint (no `every_steps`, no `at_end`), whose pending tasks hold that
    micro-batch's; the resumed run starts at step 8 and trains every task exactly once."""
    cfg = make_config(
        tmp_path,
        train={"total_steps": 100, "total_epochs": 1, "groups_per_step": 4},
        coordinator={"pipeline_depth": 2, "max_staleness": 2},
        checkpoint={"every_steps": 0, "resume": "auto", "at_end": False},
        algorithm={"filter_zero_variance": False},
    )
    rng = random.Random(0)
    latency = lambda: rng.expovariate(1.0)  # noqa: E731
    workflow = ScriptedWorkflow(reward=lambda t, i, a: float(i % 2))
    first: UnifiedTrainer

    def interrupt_at(n: int) -> bool:
        # Two micro-batches per step: the 15th forward_backward is step 8's first.
        if n == 15:
            assert first.interrupt()
        return False

    interrupted = FakeBackend(latency=latency, fb_fault=interrupt_at)
    first = UnifiedTrainer(cfg, backend=interrupted, workflow=workflow, train_tasks=tasks(40))
    records = run(first.fit(), virtual=True)
    assert first.interrupted and interrupted.closed
    assert records[-1]["step"] == 7
    assert [p.name for p in (cfg.run_path / "checkpoints").iterdir()] == ["step_7"]
    assert len(interrupted.trained) == 8, "step 8's first micro-batch was trained, not stepped"
    assert not first.interrupt(), "no fit runs any more"

    resumed_backend = FakeBackend(latency=latency)
    second = UnifiedTrainer(cfg, backend=resumed_backend, workflow=workflow, train_tasks=tasks(40))
    resumed = run(second.fit(), virtual=True)
    assert resumed[0]["step"] == 8 and not second.interrupted
    lineage = [tid for step in interrupted.trained[:7] for tid, _ in step]
    lineage += [tid for step in resumed_backend.trained for tid, _ in step]
    assert sorted(lineage) == sorted(f"t{i}" for i in range(40)), "each task exactly once"
