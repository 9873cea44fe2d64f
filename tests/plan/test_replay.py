"""`rllm-async plan` (`rllm_async.plan.replay`): the replay reproduces a recorded sim run, and the
recommendation keeps its budget."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rllm_async.backends.sim import SimBackend
from rllm_async.cli import main
from rllm_async.config import ConfigError
from rllm_async.plan.fit import FittedWorkload, fit_workload
from rllm_async.plan.record import read_workload
from rllm_async.plan.replay import (
    Candidate,
    plan,
    recorded_candidate,
    replay,
    replay_rows,
    sim_config,
    workflow,
)
from rllm_async.plan.simulate import QUIET
from rllm_async.trainer import UnifiedTrainer
from tests.plan.runs import STEPS, record_run


def _ks_statistic(a: np.ndarray, b: np.ndarray) -> float:
    grid = np.union1d(a, b)
    fa = np.searchsorted(np.sort(a), grid, side="right") / len(a)
    fb = np.searchsorted(np.sort(b), grid, side="right") / len(b)
    return float(np.abs(fa - fb).max())


def test_the_fitted_workload_reproduces_the_recorded_lengths(sync_run: Path) -> None:
    workload = read_workload(sync_run)
    f = fit_workload(workload)
    recorded = np.array([r.completion for r in workload.rollouts])
    quiet = [f"run_dir={sync_run / 'replay'}", *QUIET]
    config = sim_config(f, recorded_candidate(f), STEPS, 7, quiet)
    trainer = UnifiedTrainer(config, workflow=workflow(f, 7))
    trainer.run()
    assert isinstance(trainer.backend, SimBackend)
    replayed = np.array([n for step in trainer.backend.trained for g in step for n in g[4]])
    # Two-sample Kolmogorov-Smirnov at the 1% level (critical value 1.628 sqrt((n+m)/(n m))).
    n, m = len(recorded), len(replayed)
    assert _ks_statistic(recorded, replayed) < 1.628 * np.sqrt((n + m) / (n * m))
    assert np.median(replayed) == pytest.approx(np.median(recorded), rel=0.1)


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_the_replay_recovers_a_run_whose_rollouts_wait_outside_model_calls(
    tmp_path: Path, mode: str
) -> None:
    # Each rollout waits 40 s after its model call (a slow reward or environment), about as long
    # as the call itself: the engine is idle for it, which the replay must know to match.
    settings = (
        ["coordinator.pipeline_depth=2", "coordinator.max_staleness=null"]
        if mode == "async"
        else ["mode=sync", "coordinator.max_staleness=0"]
    )
    run = record_run(tmp_path, "workflow.args.reward_delay_s=40.0", *settings)
    f = fit_workload(read_workload(run))
    assert all(g.rollouts[0].tool_s == pytest.approx(40.0) for g in f.groups)
    predicted = replay(f, recorded_candidate(f), STEPS)["step_s"]
    assert predicted == pytest.approx(f.measured_step_s, rel=0.05)


@pytest.mark.parametrize("run", ["async_run", "sync_run"])
def test_the_replay_of_the_recorded_setting_recovers_its_step_time(
    run: str, request: pytest.FixtureRequest
) -> None:
    f = fit_workload(read_workload(request.getfixturevalue(run)))
    predicted = replay(f, recorded_candidate(f), STEPS)["step_s"]
    assert predicted == pytest.approx(f.measured_step_s, rel=0.05)


def test_the_recommendation_keeps_the_budget_when_replayed(small_run: Path) -> None:
    grid = {"depths": [1, 2, 4], "bounds": ["none", "d"], "concurrency": [1.0, 0.5]}
    result = plan(small_run, max_waste=0.03, max_staleness=2, grid=grid)
    rec = result["recommendation"]
    assert rec is not None and rec["waste"] <= 0.03 and rec["staleness_max"] <= 2
    f = fit_workload(read_workload(small_run))
    again = replay(
        f,
        Candidate(
            rec["mode"],
            rec["pipeline_depth"],
            rec["max_staleness"],
            rec["stale_policy"],
            rec["max_concurrency"],
        ),
        result["steps"],
    )
    assert again["waste"] <= 0.03 and again["staleness_max"] <= 2 and again["violations"] == 0
    assert again["step_s"] == pytest.approx(rec["step_s"], rel=1e-3)
    faster = [r for r in result["candidates"] if r["step_s"] < rec["step_s"]]
    assert all(r["waste"] > 0.03 or r["staleness_max"] > 2 for r in faster)


def test_the_command_prints_the_plan_and_what_is_assumed(
    small_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["plan", str(small_run), "--depths", "2", "--bounds", "d", "--concurrency", "1"]
    assert main([*argv, "--scale-servers", "10", "--max-staleness", "4"]) == 0
    out = capsys.readouterr().out
    assert "10x rollout servers" in out and "assumed:" in out and "measured:" in out
    assert "recommended under" in out and "d=2 K=2" in out
    assert main(["plan", str(small_run / "missing")]) == 2


@pytest.mark.parametrize("known", [True, False])
def test_the_replay_filters_groups_as_recorded(small_run: Path, known: bool) -> None:
    workload = read_workload(small_run)
    assert fit_workload(workload).filter_rate == 0.0
    workload.meta["groups"] = {"consumed": 60, "filtered": 40, "failed": 0, "dropped_stale": 0}
    # A sim run filters nothing (the groups its end cancelled are not known).
    assert {row.filtered for row in workload.rollouts} == {False, None}
    for row in workload.rollouts:  # 40% of the groups filtered, or no outcome known
        assert row.group is not None
        row.filtered = row.group % 5 < 2 if known else None
    f = fit_workload(workload)
    assert f.filter_rate == 0.4
    assert {g.filtered for g in f.groups} == ({False, True} if known else {None})
    out = replay(f, recorded_candidate(f), 12)
    assert 0.25 < out["waste_steady"] < 0.55  # filtered groups' tokens are wasted
    assert out["steps"] == 12


def test_each_task_draws_a_recorded_group_and_filters_as_it_did(small_run: Path) -> None:
    workload = read_workload(small_run)
    workload.meta["groups"] = {"consumed": 50, "filtered": 50}
    for row in workload.rollouts:
        row.filtered = row.group is not None and row.group % 2 == 0
    f = fit_workload(workload)
    recorded = {(tuple(r.completion for r in g.rollouts), g.filtered) for g in f.groups}
    quiet = [f"run_dir={small_run / 'groups'}", *QUIET]
    config = sim_config(f, recorded_candidate(f), 6, 3, quiet)
    trainer = UnifiedTrainer(config, workflow=workflow(f, 3))
    trainer.run()
    assert isinstance(trainer.backend, SimBackend)
    # Every trained group is one the record kept whole and did not filter.
    trained = [tuple(g[4]) for step in trainer.backend.trained for g in step]
    assert trained and all((lengths, False) in recorded for lengths in trained)


def test_a_plan_on_a_shared_device_predicts_the_other_mode(tmp_path: Path) -> None:
    # Training as long as sync generation, on a device both share evenly: each mode's record,
    # replayed in the other mode, predicts that mode's measured step time within 10%; at the
    # recorded mode's speeds it would miss by more.
    shared = ["backend.train_ratio=1.0", "backend.train_share=0.5", "backend.learner_share=0.5"]
    runs = {
        "async": record_run(
            tmp_path / "async",
            "coordinator.pipeline_depth=2",
            "coordinator.max_staleness=null",
            *shared,
        ),
        "sync": record_run(tmp_path / "sync", "mode=sync", "coordinator.max_staleness=0", *shared),
    }
    fits = {mode: fit_workload(read_workload(run)) for mode, run in runs.items()}
    # The async learner trained beside nearly all of generation: decoding alone is not seen, its
    # share there is assumed, and the rate measured beside training is kept.
    seen, cross = fits["async"], fits["async"].other
    assert cross is not None and cross.train_share == 0.5 and cross.learner_share == 0.5
    assert cross.rmax * cross.train_share == pytest.approx(seen.rmax * seen.train_share)
    assert any("too much to see it alone" in a for a in seen.assumed)
    for mode, other in (("async", "sync"), ("sync", "async")):
        target = fits[mode]
        setting = recorded_candidate(target)
        predicted = replay(fits[other], setting, STEPS)["step_s"]
        assert predicted == pytest.approx(target.measured_step_s, rel=0.10)
        unshared = replay(dataclasses.replace(fits[other], other=None), setting, STEPS)["step_s"]
        assert abs(unshared / target.measured_step_s - 1) > 0.15


@pytest.mark.parametrize(("train_ratio", "more_for"), [(0.1, "generation"), (3.0, "training")])
def test_the_best_split_gives_more_devices_to_the_side_that_takes_longer(
    tmp_path: Path, train_ratio: float, more_for: str
) -> None:
    run = record_run(
        tmp_path,
        "train.total_steps=8",
        "train.groups_per_step=8",
        "backend.slots=128",
        "rollout.max_concurrency=128",
        f"backend.train_ratio={train_ratio}",
        "coordinator.pipeline_depth=1",
        "coordinator.max_staleness=null",
    )
    grid = {"depths": [1, 2], "bounds": ["none"], "concurrency": [1.0]}
    result = plan(run, steps=8, grid=grid, devices=6, max_staleness=2)
    splits = result["device_splits"]
    assert [(s["generation_devices"], s["training_devices"]) for s in splits["splits"]] == [
        (g, 6 - g) for g in range(1, 6)
    ]
    best = splits["recommendation"]
    assert best["best"]["staleness_max"] <= 2
    assert best["best"]["step_s"] == min(s["best"]["step_s"] for s in splits["splits"])
    gen, train = best["generation_devices"], best["training_devices"]
    assert gen > train if more_for == "generation" else train > gen


def test_the_command_refuses_a_split_it_cannot_read(
    small_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", str(small_run), "--devices", "4", "--recorded-devices", "1x1"]) == 2
    assert "GEN:TRAIN" in capsys.readouterr().err
    assert main(["plan", str(small_run), "--devices", "1"]) == 2
    assert "2 devices or more" in capsys.readouterr().err


def test_a_twin_record_replays_the_other_mode_from_its_own_fit(
    async_run: Path, sync_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    grid = {"depths": [2], "bounds": ["none"], "concurrency": [1.0]}
    result = plan(async_run, twin=sync_run, grid=grid)
    twin_fit = fit_workload(read_workload(sync_run))
    alone = replay(twin_fit, recorded_candidate(twin_fit), result["steps"])["step_s"]
    twin = result["twin"]
    assert twin["setting"] == "sync" and twin["step_s"] == pytest.approx(alone, abs=1e-4)
    assert twin["measured_step_s"] == pytest.approx(twin_fit.measured_step_s, abs=1e-4)
    assert twin["step_s"] == pytest.approx(twin["measured_step_s"], rel=0.05)
    sync_row = next(r for r in result["candidates"] if r["setting"] == "sync")
    assert sync_row["step_s"] == twin["step_s"]
    assert any(
        m.startswith("replays of sync mode, from the twin record") for m in result["measured"]
    )
    own = plan(async_run, grid=grid)
    assert own["twin"] is None and own["recorded"]["step_s"] == result["recorded"]["step_s"]
    argv = ["plan", str(sync_run), "--twin", str(async_run), "--depths", "2", "--bounds", "none"]
    assert main([*argv, "--concurrency", "1"]) == 0
    assert "twin's recorded setting (d=2 K=none" in capsys.readouterr().out


def test_the_plan_refuses_a_twin_of_the_same_mode_another_job_or_a_split(
    async_run: Path, sync_run: Path, small_run: Path, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match="both records ran mode: async"):
        plan(async_run, twin=small_run)
    other_job = record_run(tmp_path, "mode=sync", "train.total_steps=2", "train.groups_per_step=8")
    with pytest.raises(ConfigError, match="different jobs \\(groups_per_step 32 and 8\\)"):
        plan(async_run, twin=other_job)
    with pytest.raises(ConfigError, match="--devices with --twin"):
        plan(async_run, twin=sync_run, devices=4)


def test_a_setting_given_twice_is_replayed_once(
    small_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = fit_workload(read_workload(small_run))
    setting = recorded_candidate(f)
    calls: list[Candidate] = []

    def counted(f: FittedWorkload, c: Candidate, steps: int, seed: int = 0) -> dict[str, Any]:
        calls.append(c)
        return replay(f, c, steps, seed)

    monkeypatch.setattr("rllm_async.plan.replay.replay", counted)
    first, again = replay_rows(f, [setting, setting], 4)
    assert calls == [setting] and first == again


def test_the_plan_replays_the_depth_controller_among_its_candidates(
    small_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["plan", str(small_run), "--depths", "2,auto", "--bounds", "none,d,4", "--json"]
    assert main([*argv, "--concurrency", "1", "--steps", "6"]) == 0
    rows = json.loads(capsys.readouterr().out)["candidates"]
    auto = [(r["setting"], r["max_staleness"]) for r in rows if r["pipeline_depth"] == "auto"]
    assert auto == [("d=auto K=none", None), ("d=auto K=4 requeue", 4)]  # no `d` bound for auto
    assert all(r["violations"] == 0 and r["step_s"] > 0 for r in rows)
