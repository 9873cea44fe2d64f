"""Eval on a pinned version, callbacks, sync warm-up, datasets and the single-turn workflow."""

from __future__ import annotations

import asyncio
import json

import pytest

from rllm_async import Callback, SingleTurnWorkflow
from rllm_async.config import DatasetConfig
from rllm_async.data import DataError, load_tasks
from rllm_async.plot import read_records
from rllm_async.trainer import UnifiedTrainer
from rllm_async.vclock import run
from tests.fakes import FakeBackend, ScriptedWorkflow, make_config, tasks


class Recorder(Callback):
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def on_train_start(self, step):
        self.calls.append(("train_start", step))

    def on_train_end(self, step):
        self.calls.append(("train_end", step))

    def on_epoch_start(self, epoch):
        self.calls.append(("epoch_start", epoch))

    def on_epoch_end(self, epoch):
        self.calls.append(("epoch_end", epoch))

    def on_step_end(self, step, metrics):
        self.calls.append(("step_end", step, metrics["step"]))

    def on_eval_end(self, step, metrics):
        self.calls.append(("eval_end", step, metrics["eval/policy_version"]))


class SlowEval(ScriptedWorkflow):
    """Evaluation rollouts (task ids `e*`) take `eval_s` seconds."""

    def __init__(self, eval_s: float) -> None:
        super().__init__()
        self.eval_s = eval_s

    async def run(self, task, ctx):
        if task["id"].startswith("e"):
            await asyncio.sleep(self.eval_s)
        return await super().run(task, ctx)


def _eval_run(
    tmp_path, every: int, *, eval_s: float = 0.0, epochs=None, callbacks=(), mode="async"
):
    """A run of 6 steps of 2 groups on the fake backend, evaluating every `every` steps."""
    cfg = make_config(
        tmp_path,
        mode=mode,
        train={"total_steps": 6, "groups_per_step": 2, "total_epochs": epochs},
        eval={"every_steps": every, "at_end": every > 0},
    )
    backend = FakeBackend(latency=lambda: 0.5, train_s=0.1)
    trainer = UnifiedTrainer(
        cfg,
        backend=backend,
        workflow=SlowEval(eval_s),
        callbacks=list(callbacks),
        train_tasks=tasks(6),
        eval_tasks=[{"id": f"e{i}"} for i in range(5)],
    )
    return backend, run(trainer.fit(), virtual=True)


def test_eval_every_n_steps_on_one_pinned_version_and_callbacks(tmp_path) -> None:
    rec = Recorder()
    backend, records = _eval_run(tmp_path, 2, callbacks=[rec])
    evals = [(r["step"], r["eval/policy_version"], r["eval/n"]) for r in records if "eval/n" in r]
    # Each evaluation scores the version of the step it was due at and lands in the first record
    # written after it finishes; the last step waits for the one of version 4 and runs the final
    # one, each in a record of its own.
    assert [(v, n) for _, v, n in evals] == [(2.0, 5.0), (4.0, 5.0), (6.0, 5.0)]
    assert evals[0][0] in (3, 4) and evals[1][0] == 6 and evals[2][0] == 6
    assert [c[1:] for c in rec.calls if c[0] == "eval_end"] == [(2, 2.0), (4, 4.0), (6, 6.0)]
    assert rec.calls[0] == ("train_start", 0) and rec.calls[-1] == ("train_end", 6)
    assert [c[1] for c in rec.calls if c[0] == "step_end"] == [1, 2, 3, 4, 5, 6]
    assert ("epoch_start", 0) in rec.calls and ("epoch_end", 0) in rec.calls
    assert ("epoch_start", 1) in rec.calls
    assert backend.policy().live == {}, "the eval snapshots are released"
    # The evaluations of versions 2 and 4 ran beside training, queued behind rollouts.
    assert backend.policy().priorities.count(1) == 2 * 5


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_evaluations_run_beside_training_without_holding_it_up(tmp_path, mode) -> None:
    _, plain = _eval_run(tmp_path / "plain", 0, mode=mode)
    _, evaluated = _eval_run(tmp_path / "evaluated", 2, eval_s=3.0, mode=mode)
    steps = [r for r in evaluated if "time/step_s" in r]
    # Every step keeps its pace while the 3-second evaluations of versions 2 and 4 run one after
    # the other, each on the version it pinned when it was due.
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert [r["time/elapsed_s"] for r in steps] == pytest.approx(
        [r["time/elapsed_s"] for r in plain]
    )
    assert not any("eval/n" in r for r in steps[:5])
    # Only the last step waits: for both, then for the final evaluation, a record each; the three
    # ran one after the other from step 2 on.
    lands = [(r["step"], r["eval/policy_version"]) for r in evaluated if "eval/n" in r]
    assert lands == [(6, 2.0), (6, 4.0), (6, 6.0)]
    assert evaluated[-1]["time/elapsed_s"] >= steps[1]["time/elapsed_s"] + 3 * 3.0


def test_an_evaluation_due_while_another_waits_to_start_replaces_it(tmp_path) -> None:
    backend, records = _eval_run(tmp_path, 1, eval_s=3.0)
    # Version 1's evaluation runs from step 1 to past the last step; those of versions 2, 3 and 4
    # each wait to start and are replaced by the next one due, until version 5's, which runs.
    lands = [(r["eval/policy_version"], r.get("eval/skipped")) for r in records if "eval/n" in r]
    assert lands == [(1.0, None), (5.0, 3.0), (6.0, None)]
    assert [r["step"] for r in records if "time/step_s" in r] == [1, 2, 3, 4, 5, 6]
    assert backend.policy().live == {}, "the pins of the replaced evaluations are released"


def test_evaluations_after_the_data_ran_out_get_records_of_the_last_step(tmp_path) -> None:
    # One epoch of 6 tasks is 3 steps of the 6 asked for: the data ends first.
    backend, records = _eval_run(tmp_path, 2, eval_s=3.0, epochs=1)
    assert [r["step"] for r in records] == [1, 2, 3, 3, 3]
    assert [r.get("eval/policy_version") for r in records] == [None, None, None, 2.0, 3.0]
    assert records[-1]["time/elapsed_s"] >= records[-2]["time/elapsed_s"] + 3.0
    assert backend.policy().live == {}
    merged = read_records(tmp_path / "runs" / "test")
    assert [r["step"] for r in merged] == [1, 2, 3]
    assert merged[-1]["eval/policy_version"] == 3.0 and "time/step_s" in merged[-1]


def test_eval_at_start_scores_the_starting_policy_outside_the_timed_run(tmp_path) -> None:
    def fit(at_start: bool, name: str) -> list[dict]:
        cfg = make_config(
            tmp_path / name,
            train={"total_steps": 2, "groups_per_step": 2},
            eval={"at_start": at_start, "at_end": False},
        )
        trainer = UnifiedTrainer(
            cfg,
            backend=FakeBackend(latency=lambda: 0.5, train_s=0.1),
            workflow=ScriptedWorkflow(),
            train_tasks=tasks(6),
            eval_tasks=[{"id": f"e{i}"} for i in range(5)],
        )
        return run(trainer.fit(), virtual=True)

    with_start, without = fit(True, "a"), fit(False, "b")
    assert with_start[0]["step"] == 0 and with_start[0]["eval/policy_version"] == 0.0
    assert with_start[0]["eval/n"] == 5.0 and with_start[0]["time/elapsed_s"] == 0.0
    assert "reward/mean" not in with_start[0]
    assert [r["step"] for r in with_start[1:]] == [1, 2]
    assert not any("eval/n" in r for r in without)
    timed = [r["time/elapsed_s"] for r in with_start[1:]]
    assert timed == pytest.approx([r["time/elapsed_s"] for r in without])
    lines = (tmp_path / "a" / "runs" / "test" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["step"] == 0


def test_sync_warmup_steps_run_on_policy_first(tmp_path) -> None:
    backend = FakeBackend(latency=lambda: 1.0, train_s=2.0)
    cfg = make_config(
        tmp_path,
        train={"total_steps": 8},
        coordinator={"pipeline_depth": 2, "max_staleness": 2, "sync_warmup_steps": 4},
    )
    records = run(
        UnifiedTrainer(
            cfg, backend=backend, workflow=ScriptedWorkflow(), train_tasks=tasks(40)
        ).fit(),
        virtual=True,
    )
    assert all(r["staleness/max"] == 0 for r in records[:4])
    assert max(r["staleness/max"] for r in records[4:]) > 0


def test_single_turn_workflow_scores_the_reply(tmp_path) -> None:
    def reward(task, text):
        return (1.0, True) if text == "AAA" else (0.0, False)

    cfg = make_config(tmp_path, train={"total_steps": 2}, algorithm={"filter_zero_variance": False})
    backend = FakeBackend()
    trainer = UnifiedTrainer(
        cfg, backend=backend, workflow=SingleTurnWorkflow(reward_fn=reward), train_tasks=tasks(10)
    )
    records = run(trainer.fit(), virtual=True)
    assert records[-1]["reward/mean"] == 1.0 and records[-1]["episode/correct"] == 1.0
    assert records[-1]["train/correct"] == 1.0
    with pytest.raises(KeyError, match="prompt_key"):
        run(
            UnifiedTrainer(
                make_config(tmp_path, name="bad", rollout={"retries": 0}),
                backend=FakeBackend(),
                workflow=SingleTurnWorkflow(reward_fn=reward, prompt_key="question"),
                train_tasks=tasks(4),
            ).workflow.run({"id": "x"}, None),  # type: ignore[arg-type]
            virtual=True,
        )


def test_bad_dataset_rows_get_clear_errors(tmp_path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "prompt": "x"}\n{not json}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: invalid JSON.*one JSON object"):
        load_tasks(DatasetConfig(path=str(bad)), "train")
    lst = tmp_path / "list.jsonl"
    lst.write_text('{"id": "a"}\n[1, 2]\n')
    with pytest.raises(DataError, match=r"row 1 .* is a list, not an object"):
        load_tasks(DatasetConfig(path=str(lst)), "train")
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"id": "a"}\n{"id": "a"}\n')
    with pytest.raises(DataError, match="duplicate task id 'a'"):
        load_tasks(DatasetConfig(path=str(dup)), "train")
    with pytest.raises(DataError, match="not found"):
        load_tasks(DatasetConfig(path=str(tmp_path / "missing.jsonl")), "train")
    ok = tmp_path / "ok.jsonl"
    ok.write_text('{"prompt": "p"}\n\n{"prompt": "q"}\n')
    assert [t["id"] for t in load_tasks(DatasetConfig(path=str(ok)), "train")] == [
        "train-0",
        "train-1",
    ]


def test_progress_bar_shows_reward_and_staleness(tmp_path, capsys) -> None:
    cfg = make_config(tmp_path, logging={"progress_bar": True}, train={"total_steps": 3})
    run(
        UnifiedTrainer(
            cfg,
            backend=FakeBackend(latency=lambda: 0.3),
            workflow=ScriptedWorkflow(),
            train_tasks=tasks(20),
        ).fit(),
        virtual=True,
    )
    err = capsys.readouterr().err
    assert "3/3" in err and "reward=" in err and "stale=" in err


def test_cli_train_and_simulate(tmp_path, capsys) -> None:
    from rllm_async.cli import main

    cfg = tmp_path / "sim.yaml"
    cfg.write_text(
        "name: cli\n"
        f"run_dir: {tmp_path}\n"
        "backend: {name: sim, latency: zero}\n"
        "workflow: {cls: 'rllm_async.workflows.sim:SimWorkflow', args: {len_median: 8}}\n"
        "data: {train: {generator: 'rllm_async.workflows.sim:synthetic_tasks', args: {n: 64}}}\n"
        "logging: {progress_bar: false}\n"
    )
    assert main(["train", str(cfg), "train.total_steps=3", "train.groups_per_step=2"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["steps"] == 3
    assert len((tmp_path / "cli" / "metrics.jsonl").read_text().splitlines()) == 3

    assert main(["train", str(cfg), "coordinator.pipline_depth=2"]) == 2
    assert "did you mean 'pipeline_depth'" in capsys.readouterr().err

    assert (
        main(["simulate", "--workload", "W2", "--pipeline-depth", "2", "--steps", "4", "--json"])
        == 0
    )
    sim = json.loads(capsys.readouterr().out)
    for key in (
        "t_sync_s",
        "t_async_s",
        "t_ideal_s",
        "speedup",
        "efficiency",
        "waste",
        "staleness_max",
        "violations",
        "trainer_idle_ratio",
    ):
        assert key in sim
    assert sim["speedup"] > 1.0 and sim["violations"] == 0


def test_plot_overlays_runs(tmp_path) -> None:
    from rllm_async.cli import main

    for name, mode in (("sync", "sync"), ("async", "async")):
        cfg = make_config(tmp_path, name=name, mode=mode, train={"total_steps": 4})
        run(
            UnifiedTrainer(
                cfg,
                backend=FakeBackend(latency=lambda: 0.2),
                workflow=ScriptedWorkflow(),
                train_tasks=tasks(30),
            ).fit(),
            virtual=True,
        )
    runs = tmp_path / "runs"
    assert (
        main(["plot", str(runs / "sync"), str(runs / "async"), "--out", str(tmp_path / "p")]) == 0
    )
    for name in ("by_step.png", "by_time.png"):
        data = (tmp_path / "p" / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 10_000
    assert main(["plot", str(tmp_path / "nope")]) == 2
