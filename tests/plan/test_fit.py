"""The workload fit (`rllm_async.plan.fit`): what it recovers of a recorded run, what it says it
measured and assumed, and how a fitted workload scales."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest

from rllm_async.backends.sim import SimBackend, ps_rate, workload_config
from rllm_async.config import ConfigError
from rllm_async.plan.fit import engine_slots, fit_workload, shared_device
from rllm_async.plan.record import OFFSETS, RolloutRow, StepRow, Workload, read_workload
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


# A record written by hand: rollouts decoding under processor sharing with R(n) = rmax n /
# (n + n_half), each at a steady load n, part of its time beside training (at `TRAIN_SHARE` of the
# rate) and part beside a weight sync (at `SYNC_SHARE`). The fit knows none of these numbers.
RMAX, N_HALF, TRAIN_SHARE, SYNC_SHARE = 5000.0, 16.0, 0.5, 0.0
TRAIN_RATE, T_OPTIM, T_SYNC, STEP_S = 2000.0, 0.2, 0.3, 5.0
GROUP_SIZE = 4


def _rollout(rng: np.random.Generator, group: int, load: float | None) -> RolloutRow:
    """One rollout of `group` at a steady `load` (drawn in 1-256 when None): its length is what
    the rate gives it over its time alone, beside training and beside a sync."""
    n = float(rng.uniform(1.0, 256.0)) if load is None else load
    seconds = float(rng.uniform(5.0, 50.0))
    start = float(rng.uniform(0.0, 10.0))
    training, syncing = float(rng.uniform(0.0, 0.6)), float(rng.uniform(0.0, 0.2))

    def inv(part: float) -> list[float]:
        return [part * seconds / (n + c) for c in OFFSETS]

    decoding = (1 - training - syncing) + TRAIN_SHARE * training + SYNC_SHARE * syncing
    return RolloutRow(
        start=start,
        end=start + seconds,
        prompt=10,
        completion=round(RMAX * decoding * seconds / (n + N_HALF)),
        turns=1,
        active=n,
        inv=inv(1.0),
        tool_s=0.0,
        inv_train=inv(training),
        inv_sync=inv(syncing),
        group=group,
        filtered=False,
    )


def _workload(load: float | None = None, groups: int = 100) -> Workload:
    """`groups` groups of the rollouts above, and ten steps `STEP_S` apart whose first one warms
    up (its training, optimizer step and sync twice as slow)."""
    rng = np.random.default_rng(0)
    rows = [_rollout(rng, i // GROUP_SIZE, load) for i in range(groups * GROUP_SIZE)]
    steps = []
    for i in range(10):
        warm = 2.0 if i == 0 else 1.0
        tokens = 1000 * (i + 1)
        train_s = warm * tokens / TRAIN_RATE
        steps.append(StepRow(i, 1.0 + STEP_S * i, tokens, train_s, warm * T_OPTIM, warm * T_SYNC))
    meta = {
        "mode": "async",
        "group_size": GROUP_SIZE,
        "groups_per_step": 8,
        "max_concurrency": 256,
        "groups": {"consumed": 30, "filtered": 10},
    }
    return Workload(meta, rows, steps, rollouts_seen=len(rows))


def test_the_fit_recovers_the_rate_its_shares_and_the_learners_times_from_a_record() -> None:
    workload = _workload()
    f = fit_workload(workload)
    # The lengths are rounded to whole tokens (under 0.5% of the shortest): rmax within 1%, and
    # n_half and the shares exactly, as they are fitted on grids that hold the true values.
    assert f.rmax == pytest.approx(RMAX, rel=0.01)
    assert f.n_half == N_HALF and (f.train_share, f.sync_share) == (TRAIN_SHARE, SYNC_SHARE)
    assert any(m.startswith("decode rate vs concurrency: R(n) = ") for m in f.measured)
    # The first step's warm-up is left out of the learner's speed and times, and of the step time.
    assert f.train_rate == pytest.approx(TRAIN_RATE)
    assert (f.t_optim, f.t_sync) == (pytest.approx(T_OPTIM), pytest.approx(T_SYNC))
    assert f.measured_step_s == pytest.approx(STEP_S)
    assert f.filter_rate == pytest.approx(0.25)
    # The replay draws whole recorded groups: each of the record's groups, with its lengths.
    recorded: dict[int, list[int]] = {}
    for row in workload.rollouts:
        assert row.group is not None
        recorded.setdefault(row.group, []).append(row.completion)
    drawn = sorted(sorted(r.completion for r in g.rollouts) for g in f.groups)
    assert drawn == sorted(sorted(lengths) for lengths in recorded.values())
    assert f.lengths == sorted(r.completion for r in workload.rollouts)


def test_at_one_concurrency_the_fit_assumes_n_half_and_keeps_the_rate_seen_there() -> None:
    f = fit_workload(_workload(load=32.0))
    assert f.n_half == 64.0  # the default: the record cannot tell it
    assert any("so n_half = 64 is assumed" in a for a in f.assumed)
    assert ps_rate(32, f.rmax, f.n_half) == pytest.approx(ps_rate(32, RMAX, N_HALF), rel=0.01)


def test_a_fitted_workload_scales_its_servers_and_its_batch() -> None:
    f = fit_workload(_workload())
    big = f.scaled(servers=2.0, batch=3.0)
    for n in (1, 32, 256):  # twice the servers decode twice as fast at twice the concurrency
        assert ps_rate(2 * n, big.rmax, big.n_half) == pytest.approx(
            2 * ps_rate(n, f.rmax, f.n_half)
        )
    assert big.meta["max_concurrency"] == 512 and big.meta["groups_per_step"] == 24
    assert (big.train_rate, big.t_optim, big.t_sync) == (f.train_rate, f.t_optim, f.t_sync)
    assert math.isnan(big.measured_step_s) and f.scaled().measured_step_s == f.measured_step_s
    assert len(big.assumed) == len(f.assumed) + 2 and f.meta["max_concurrency"] == 256


def test_a_record_without_rollouts_or_steps_cannot_be_fitted() -> None:
    workload = _workload(groups=1)
    with pytest.raises(ConfigError, match="no finished rollouts or no steps"):
        fit_workload(dataclasses.replace(workload, steps=[]))
    with pytest.raises(ConfigError, match="no finished rollouts or no steps"):
        fit_workload(dataclasses.replace(workload, rollouts=[]))


@pytest.mark.parametrize(
    ("train_rate", "setting"),
    [
        (3000.0, ["mode=sync", "coordinator.max_staleness=0"]),
        (20000.0, ["coordinator.pipeline_depth=2", "coordinator.max_staleness=null"]),
    ],
)
def test_the_fit_recovers_a_sim_engine_and_learner_of_other_parameters(
    tmp_path: Path, train_rate: float, setting: list[str]
) -> None:
    # The sim backend with parameters other than W1's: rmax, n_half (on the grid `OFFSETS` the fit
    # searches), the learner's tokens/s, and its optimizer-step and sync seconds. (Where an async
    # learner trains beside nearly all of generation, a share of the rate it keeps beside training
    # trades off against rmax: the async run's learner is fast.)
    backend = {"rmax": 8000.0, "n_half": 16.0, "train_rate": train_rate, "t_optim": 0.25}
    run = record_run(
        tmp_path,
        "train.total_steps=10",
        "train.groups_per_step=8",
        "backend.slots=128",
        "rollout.max_concurrency=128",
        "backend.train_ratio=null",
        *(f"backend.{k}={v}" for k, v in backend.items()),
        "backend.t_sync=1.5",
        *setting,
    )
    f = fit_workload(read_workload(run))
    assert f.rmax == pytest.approx(8000.0, rel=0.02) and f.n_half == 16.0
    assert f.train_rate == pytest.approx(train_rate, rel=1e-6)
    assert f.t_optim == pytest.approx(0.25) and f.t_sync == pytest.approx(1.5)
    assert (f.train_share, f.sync_share) == (1.0, 1.0)
