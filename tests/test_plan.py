"""`rllm-async plan`: the fit reproduces a recorded sim run, and the recommendation keeps its budget."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rllm_async.backends.sim import SimBackend, workload_config
from rllm_async.cli import main
from rllm_async.config import ConfigError
from rllm_async.plan import (
    Candidate,
    fit,
    plan,
    recorded_candidate,
    replay,
    replay_rows,
    sim_config,
    workflow,
)
from rllm_async.simulate import QUIET
from rllm_async.trainer import UnifiedTrainer
from rllm_async.workload_fit import Fit, engine_slots, shared_device
from rllm_async.workload_record import Workload, read_workload

# W1 (32 groups of 8 per step): smaller batches make one run's step time vary by +-5% with the
# seed (the step waits for its longest rollouts), so a run could not be predicted within 5%.
STEPS = 20


def _record(root: Path, *overrides: str) -> Path:
    config = workload_config(
        "W1", [f"run_dir={root}", *QUIET, f"train.total_steps={STEPS}", *overrides]
    )
    UnifiedTrainer(config).run()
    return root


@pytest.fixture(scope="module")
def async_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _record(
        tmp_path_factory.mktemp("async"),
        "coordinator.pipeline_depth=2",
        "coordinator.max_staleness=null",
    )


@pytest.fixture(scope="module")
def small_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """W1 at a quarter of its size: 8 groups of 8 per step on 128 decode slots, 12 steps."""
    return _record(
        tmp_path_factory.mktemp("small"),
        "train.total_steps=12",
        "train.groups_per_step=8",
        "backend.slots=128",
        "rollout.max_concurrency=128",
        "coordinator.pipeline_depth=2",
        "coordinator.max_staleness=null",
    )


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _record(tmp_path_factory.mktemp("sync"), "mode=sync", "coordinator.max_staleness=0")


def _ks_statistic(a: np.ndarray, b: np.ndarray) -> float:
    grid = np.union1d(a, b)
    fa = np.searchsorted(np.sort(a), grid, side="right") / len(a)
    fb = np.searchsorted(np.sort(b), grid, side="right") / len(b)
    return float(np.abs(fa - fb).max())


def test_the_fit_recovers_the_simulated_engine_and_trainer(sync_run: Path) -> None:
    f = fit(read_workload(sync_run))
    assert f.rmax == pytest.approx(20000.0, rel=0.02) and f.n_half == 64.0
    assert f.t_sync == 0.5 and f.t_optim == 0.0
    backend = SimBackend.from_config(workload_config("W1"))
    assert f.train_rate == pytest.approx(backend.train_rate, rel=1e-6)


def test_the_fitted_workload_reproduces_the_recorded_lengths(sync_run: Path) -> None:
    workload = read_workload(sync_run)
    f = fit(workload)
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
    run = _record(tmp_path, "workflow.args.reward_delay_s=40.0", *settings)
    f = fit(read_workload(run))
    assert all(g.rollouts[0].tool_s == pytest.approx(40.0) for g in f.groups)
    predicted = replay(f, recorded_candidate(f), STEPS)["step_s"]
    assert predicted == pytest.approx(f.measured_step_s, rel=0.05)


@pytest.mark.parametrize("run", ["async_run", "sync_run"])
def test_the_replay_of_the_recorded_setting_recovers_its_step_time(
    run: str, request: pytest.FixtureRequest
) -> None:
    f = fit(read_workload(request.getfixturevalue(run)))
    predicted = replay(f, recorded_candidate(f), STEPS)["step_s"]
    assert predicted == pytest.approx(f.measured_step_s, rel=0.05)


def test_the_recommendation_keeps_the_budget_when_replayed(small_run: Path) -> None:
    grid = {"depths": [1, 2, 4], "bounds": ["none", "d"], "concurrency": [1.0, 0.5]}
    result = plan(small_run, max_waste=0.03, max_staleness=2, grid=grid)
    rec = result["recommendation"]
    assert rec is not None and rec["waste"] <= 0.03 and rec["staleness_max"] <= 2
    f = fit(read_workload(small_run))
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
    assert fit(workload).filter_rate == 0.0
    workload.meta["groups"] = {"consumed": 60, "filtered": 40, "failed": 0, "dropped_stale": 0}
    # A sim run filters nothing (the groups its end cancelled are not known).
    assert {row.filtered for row in workload.rollouts} == {False, None}
    for row in workload.rollouts:  # 40% of the groups filtered, or no outcome known
        assert row.group is not None
        row.filtered = row.group % 5 < 2 if known else None
    f = fit(workload)
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
    f = fit(workload)
    recorded = {(tuple(r.completion for r in g.rollouts), g.filtered) for g in f.groups}
    quiet = [f"run_dir={small_run / 'groups'}", *QUIET]
    config = sim_config(f, recorded_candidate(f), 6, 3, quiet)
    trainer = UnifiedTrainer(config, workflow=workflow(f, 3))
    trainer.run()
    assert isinstance(trainer.backend, SimBackend)
    # Every trained group is one the record kept whole and did not filter.
    trained = [tuple(g[4]) for step in trainer.backend.trained for g in step]
    assert trained and all((lengths, False) in recorded for lengths in trained)


def test_the_fit_recovers_how_much_decoding_slows_beside_training_and_syncs(
    tmp_path: Path,
) -> None:
    run = _record(
        tmp_path,
        "coordinator.pipeline_depth=2",
        "coordinator.max_staleness=null",
        "backend.train_share=0.5",
        "backend.sync_share=0.0",
    )
    f = fit(read_workload(run))
    assert (f.train_share, f.sync_share) == (0.5, 0.0)
    assert f.rmax == pytest.approx(20000.0, rel=0.02) and f.n_half == 64.0
    predicted = replay(f, recorded_candidate(f), STEPS)["step_s"]
    assert predicted == pytest.approx(f.measured_step_s, rel=0.05)


def test_the_fit_measures_the_learners_share_beside_generation_from_a_sync_record(
    tmp_path: Path,
) -> None:
    # In sync mode the first micro-batches train beside the step's last rollouts, the others
    # alone: the forward-backward calls tell the learner's speed alone and beside generation.
    shares = ["backend.train_share=0.6", "backend.learner_share=0.7"]
    run = _record(tmp_path / "sync", "mode=sync", "coordinator.max_staleness=0", *shares)
    f = fit(read_workload(run))
    assert f.shared_device is True and f.other is not None and f.learner_share == 1.0
    alone = SimBackend.from_config(workload_config("W1")).train_rate
    assert f.other.learner_share == pytest.approx(0.7, abs=1e-6)
    assert f.other.train_rate == pytest.approx(alone, rel=1e-6)
    assert f.other.train_share == pytest.approx(0.6)
    assert any("keeping 70% of that beside generation" in m for m in f.measured)
    # An async run trains beside rollouts throughout: its learner's share is assumed.
    run = _record(
        tmp_path / "async",
        "coordinator.pipeline_depth=2",
        "coordinator.max_staleness=null",
        *shares,
    )
    f = fit(read_workload(run))
    assert f.other is not None and f.other.learner_share == pytest.approx(0.6)
    assert any("the share decoding keeps beside training" in a for a in f.assumed)


def test_a_plan_on_a_shared_device_predicts_the_other_mode(tmp_path: Path) -> None:
    # Training as long as sync generation, on a device both share evenly: each mode's record,
    # replayed in the other mode, predicts that mode's measured step time within 10%; at the
    # recorded mode's speeds it would miss by more.
    shared = ["backend.train_ratio=1.0", "backend.train_share=0.5", "backend.learner_share=0.5"]
    runs = {
        "async": _record(
            tmp_path / "async",
            "coordinator.pipeline_depth=2",
            "coordinator.max_staleness=null",
            *shared,
        ),
        "sync": _record(tmp_path / "sync", "mode=sync", "coordinator.max_staleness=0", *shared),
    }
    fits = {mode: fit(read_workload(run)) for mode, run in runs.items()}
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


def test_the_backend_in_the_runs_config_says_whether_the_device_was_shared() -> None:
    def shared(backend: dict[str, object] | None) -> bool | None:
        config = None if backend is None else {"backend": backend}
        return shared_device(Workload({"mode": "async"}, config=config))

    assert shared({"name": "local", "model": "small", "learner": "process"}) is True
    assert shared({"name": "local", "device": "cuda:0"}) is True
    assert shared({"name": "local", "rollout": "vllm"}) is None  # the servers' devices
    assert shared({"name": "sim", "learner_share": 0.5}) is True
    assert shared({"name": "sim"}) is False
    assert shared({"name": "local", "no_such_option": 1}) is None
    assert shared({"name": "no_such_backend"}) is None
    assert shared(None) is None


def test_the_runs_config_tells_how_many_sequences_the_engine_decodes_together() -> None:
    def slots(backend: dict[str, object] | None) -> int | None:
        config = None if backend is None else {"backend": backend}
        return engine_slots(Workload({"mode": "async"}, config=config))

    assert slots({"name": "local", "max_batch": 128, "device": "cuda"}) == 128
    assert slots({"name": "local"}) == 32  # the local backend's default max_batch
    assert slots({"name": "sim", "slots": 64}) == 64
    vllm = {"name": "local", "rollout": "vllm"}
    flag = ["--enforce-eager", "--max-num-seqs", "48"]
    assert slots({**vllm, "vllm": {"servers": 2, "extra_args": flag}}) == 96
    assert slots({**vllm, "vllm": {"extra_args": ["--max-num-seqs=48"]}}) == 48
    assert slots(vllm) is None  # vLLM's own default, not in the config
    assert slots({**vllm, "vllm": {"urls": ["http://h:8000"], "extra_args": flag}}) is None
    assert slots({"name": "no_such_backend"}) is None and slots(None) is None
    assert slots({**vllm, "vllm": {"extra_args": ["--max-num-seqs", "many"]}}) is None


def test_the_plan_says_where_more_rollouts_are_in_flight_than_the_engine_decodes(
    small_run: Path,
) -> None:
    # 128 rollouts in flight (8 groups of 8, two steps ahead) on 128 decode slots: told with
    # fewer slots or more concurrency than the record had, the fit names what it extrapolates
    # and changes no number.
    workload = read_workload(small_run)
    plain = fit(workload)
    assert not any("decodes at most" in a for a in plain.assumed)
    workload.config = {"backend": {"name": "sim", "slots": 64}}
    fewer = fit(workload)
    said = [a for a in fewer.assumed if "decodes at most 64 sequences" in a]
    assert len(said) == 1 and "its shape below 64" in said[0] and "hardly seen" in said[0]
    assert (fewer.rmax, fewer.n_half, fewer.train_rate) == (
        plain.rmax,
        plain.n_half,
        plain.train_rate,
    )
    workload.config = {"backend": {"name": "sim", "slots": 128}}
    workload.meta["max_concurrency"] = 512
    said = [a for a in fit(workload).assumed if "decodes at most 128 sequences" in a]
    assert len(said) == 1 and "up to 512, extrapolating R(n) above the" in said[0]


def test_a_split_scales_each_side_from_its_speed_alone(small_run: Path) -> None:
    f = fit(read_workload(small_run))
    split = f.on_devices(2.0, 3.0)
    assert split.rmax == pytest.approx(2 * f.rmax) and split.n_half == pytest.approx(2 * f.n_half)
    assert split.train_rate == pytest.approx(3 * f.train_rate)
    assert split.meta["max_concurrency"] == 2 * f.meta["max_concurrency"]
    assert (split.train_share, split.learner_share, split.shared_device) == (1.0, 1.0, False)
    assert any("training devices" in a for a in split.assumed)
    # A record from a shared device: each side's speed alone is the other mode's fit's.
    alone = dataclasses.replace(f, rmax=2 * f.rmax, train_rate=5 * f.train_rate)
    shared = dataclasses.replace(f, shared_device=True, train_share=0.5, other=alone)
    split = shared.on_devices(1.0, 1.0)
    assert split.rmax == pytest.approx(alone.rmax) and split.train_rate == alone.train_rate
    assert split.train_share == 1.0 and split.other is None


@pytest.mark.parametrize(("train_ratio", "more_for"), [(0.1, "generation"), (3.0, "training")])
def test_the_best_split_gives_more_devices_to_the_side_that_takes_longer(
    tmp_path: Path, train_ratio: float, more_for: str
) -> None:
    run = _record(
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
    twin_fit = fit(read_workload(sync_run))
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
    other_job = _record(tmp_path, "mode=sync", "train.total_steps=2", "train.groups_per_step=8")
    with pytest.raises(ConfigError, match="different jobs \\(groups_per_step 32 and 8\\)"):
        plan(async_run, twin=other_job)
    with pytest.raises(ConfigError, match="--devices with --twin"):
        plan(async_run, twin=sync_run, devices=4)


def test_a_setting_given_twice_is_replayed_once(
    small_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = fit(read_workload(small_run))
    setting = recorded_candidate(f)
    calls: list[Candidate] = []

    def counted(f: Fit, c: Candidate, steps: int, seed: int = 0) -> dict[str, Any]:
        calls.append(c)
        return replay(f, c, steps, seed)

    monkeypatch.setattr("rllm_async.plan.replay", counted)
    first, again = replay_rows(f, [setting, setting], 4)
    assert calls == [setting] and first == again
