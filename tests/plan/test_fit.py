"""The workload fit (`rllm_async.plan.fit`): what it recovers of a recorded run, what it says it
measured and assumed, and how a fitted workload scales."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from rllm_async.backends.sim import SimBackend, workload_config
from rllm_async.plan.fit import engine_slots, fit_workload, shared_device
from rllm_async.plan.record import Workload, read_workload
from rllm_async.plan.replay import recorded_candidate, replay
from tests.plan.runs import STEPS, record_run


def test_the_fit_recovers_the_simulated_engine_and_trainer(sync_run: Path) -> None:
    f = fit_workload(read_workload(sync_run))
    assert f.rmax == pytest.approx(20000.0, rel=0.02) and f.n_half == 64.0
    assert f.t_sync == 0.5 and f.t_optim == 0.0
    backend = SimBackend.from_config(workload_config("W1"))
    assert f.train_rate == pytest.approx(backend.train_rate, rel=1e-6)


def test_the_fit_recovers_how_much_decoding_slows_beside_training_and_syncs(
    tmp_path: Path,
) -> None:
    run = record_run(
        tmp_path,
        "coordinator.pipeline_depth=2",
        "coordinator.max_staleness=null",
        "backend.train_share=0.5",
        "backend.sync_share=0.0",
    )
    f = fit_workload(read_workload(run))
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
    run = record_run(tmp_path / "sync", "mode=sync", "coordinator.max_staleness=0", *shares)
    f = fit_workload(read_workload(run))
    assert f.shared_device is True and f.other is not None and f.learner_share == 1.0
    alone = SimBackend.from_config(workload_config("W1")).train_rate
    assert f.other.learner_share == pytest.approx(0.7, abs=1e-6)
    assert f.other.train_rate == pytest.approx(alone, rel=1e-6)
    assert f.other.train_share == pytest.approx(0.6)
    assert any("keeping 70% of that beside generation" in m for m in f.measured)
    # An async run trains beside rollouts throughout: its learner's share is assumed.
    run = record_run(
        tmp_path / "async",
        "coordinator.pipeline_depth=2",
        "coordinator.max_staleness=null",
        *shares,
    )
    f = fit_workload(read_workload(run))
    assert f.other is not None and f.other.learner_share == pytest.approx(0.6)
    assert any("the share decoding keeps beside training" in a for a in f.assumed)


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
    plain = fit_workload(workload)
    assert not any("decodes at most" in a for a in plain.assumed)
    workload.config = {"backend": {"name": "sim", "slots": 64}}
    fewer = fit_workload(workload)
    said = [a for a in fewer.assumed if "decodes at most 64 sequences" in a]
    assert len(said) == 1 and "its shape below 64" in said[0] and "hardly seen" in said[0]
    assert (fewer.rmax, fewer.n_half, fewer.train_rate) == (
        plain.rmax,
        plain.n_half,
        plain.train_rate,
    )
    workload.config = {"backend": {"name": "sim", "slots": 128}}
    workload.meta["max_concurrency"] = 512
    said = [a for a in fit_workload(workload).assumed if "decodes at most 128 sequences" in a]
    assert len(said) == 1 and "up to 512, extrapolating R(n) above the" in said[0]


def test_a_split_scales_each_side_from_its_speed_alone(small_run: Path) -> None:
    f = fit_workload(read_workload(small_run))
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
