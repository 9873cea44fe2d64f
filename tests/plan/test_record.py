"""The workload a run records: bounded, written into the run directory, read back as written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rllm_async.backends.sim import workload_config
from rllm_async.config import Config
from rllm_async.plan.fit import fit_workload
from rllm_async.plan.record import (
    FILE_NAME,
    OFFSETS,
    KeptGroup,
    RolloutMeter,
    WorkloadRecorder,
    read_workload,
    write_workload,
)
from rllm_async.trainer import UnifiedTrainer
from rllm_async.types import Episode, Step, Trajectory


def _episode(tokens: int, turns: int = 1) -> Episode:
    steps = [Step([1, 2, 3], [0] * tokens, [-1.0] * tokens, [0] * tokens) for _ in range(turns)]
    return Episode("t", [Trajectory(steps)])


class _Clock:
    """The time the recorders' meters read: set by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


CLOCK = _Clock()


def _begin(rec: WorkloadRecorder, now: float, group: KeptGroup | None) -> RolloutMeter:
    """A rollout of `group` that starts, and begins a model call, at `now`."""
    CLOCK.now = now
    meter = rec.started(group)
    meter.call_began()
    return meter


def _end(rec: WorkloadRecorder, now: float, meter: RolloutMeter, episode: Episode | None) -> None:
    """Its call ends at `now`, and the rollout with it."""
    CLOCK.now = now
    meter.call_ended()
    rec.finished(meter, episode)


def _phase(rec: WorkloadRecorder, now: float, name: str | None) -> None:
    """The learner starts doing `name` at `now`."""
    CLOCK.now = now
    rec.phase(name)


def _sim_run(tmp_path: Path, *overrides: str) -> Config:
    """A short W1 run of 4 groups per step into `tmp_path`; its config."""
    config = workload_config(
        "W1",
        [
            f"run_dir={tmp_path}",
            "logging.progress_bar=false",
            "checkpoint.at_end=false",
            "train.groups_per_step=4",
            *overrides,
        ],
    )
    UnifiedTrainer(config).run()
    return config


def test_a_sim_run_writes_its_workload_and_it_round_trips(tmp_path: Path) -> None:
    config = _sim_run(tmp_path, "train.total_steps=3", "coordinator.pipeline_depth=1")
    path = config.run_path / FILE_NAME
    workload = read_workload(tmp_path)  # the run directory's parent finds it too
    assert workload.meta["groups_per_step"] == 4 and workload.meta["pipeline_depth"] == 1
    assert workload.meta["groups"]["consumed"] == 12
    assert [s.step for s in workload.steps] == [1, 2, 3]
    assert all(s.tokens > 0 and s.train_s > 0 and s.sync_s == 0.5 for s in workload.steps)
    assert workload.rollouts_seen == len(workload.rollouts) >= 3 * 4 * 8
    for row in workload.rollouts:
        assert row.turns == 1 and row.prompt > 0 and row.completion > 0
        assert row.end > row.start and 1 <= row.active <= 512 and len(row.inv) == len(OFFSETS)
    copy = tmp_path / "copy.jsonl"
    write_workload(workload, copy)
    assert copy.read_text() == path.read_text()
    assert read_workload(copy) == workload


def test_the_active_count_is_time_averaged() -> None:
    rec = WorkloadRecorder({"mode": "async"}, clock=CLOCK, seed=1)
    long = _begin(rec, 0.0, rec.group_started())
    for i in range(100):
        _end(rec, 1.5 + i, _begin(rec, 1.0 + i, rec.group_started()), _episode(i + 1))
    _end(rec, 101.0, long, _episode(5000, turns=3))
    w = rec.workload
    assert w.rollouts_seen == len(w.rollouts) == 101
    (first,) = [r for r in w.rollouts if r.start == 0.0]
    assert first.turns == 3 and first.completion == 15000
    # Two active during each half second of the 100, one otherwise: 150 / 101 on average.
    assert abs(first.active - 151 / 101) < 1e-9
    assert abs(first.inv[0] - (100 * 0.5 / 2 + 51.0)) < 1e-9  # integral of dt / active
    c = OFFSETS[3]
    assert abs(first.inv[3] - (100 * 0.5 / (2 + c) + 51.0 / (1 + c))) < 1e-9


def test_the_rollouts_are_a_bounded_reservoir_of_whole_groups() -> None:
    # Groups of 4 with room for 12 rows: 3 of the 200 groups are kept whole, with their outcome.
    rec = WorkloadRecorder({"group_size": 4}, clock=CLOCK, cap=12, seed=1)
    first = rec.group_started()
    meters = [_begin(rec, 0.0, first) for _ in range(4)]  # still running while the rest pass
    for g in range(1, 200):
        group = rec.group_started()
        for _ in range(4):
            _end(rec, g + 0.5, _begin(rec, float(g), group), _episode(g))
        rec.group_ended(group, g % 2 == 0)
    for meter in meters:
        _end(rec, 300.0, meter, _episode(1000))
    rec.group_ended(first, None)
    w = rec.workload
    assert w.rollouts_seen == 800 and len(w.rollouts) == 12
    groups: dict[int | None, list[int]] = {}
    for row in w.rollouts:
        groups.setdefault(row.group, []).append(row.completion)
        assert row.filtered is (None if row.group == 0 else row.completion % 2 == 0)
    assert len(groups) == 3 and all(len(set(g)) == 1 and len(g) == 4 for g in groups.values())
    assert all(g == lengths[0] for g, lengths in groups.items())
    # The first group left the reservoir (with this seed) while its rollouts ran: their ends
    # wrote nothing.
    assert 0 not in groups


def test_failed_rollouts_are_counted_out() -> None:
    rec = WorkloadRecorder({}, clock=CLOCK, cap=10)
    _end(rec, 1.0, _begin(rec, 0.0, rec.group_started()), None)
    _end(rec, 3.0, _begin(rec, 2.0, rec.group_started()), _episode(4))
    w = rec.workload
    assert w.rollouts_seen == 1 and [r.completion for r in w.rollouts] == [4]
    assert w.rollouts[0].active == 1.0


def test_steps_gather_their_forward_backward_calls() -> None:
    rec = WorkloadRecorder({}, clock=CLOCK, cap=2)
    rec.trained(100, 1.0)
    rec.trained(50, 0.5)
    rec.step(1, 2.0, 0.1, 0.2)
    rec.step(2, 3.0, 0.1, 0.2)
    rec.step(3, 4.0, 0.1, 0.2)
    assert [(s.step, s.tokens, s.train_s) for s in rec.workload.steps] == [(1, 150, 1.5), (2, 0, 0)]


def test_the_integrals_are_split_by_what_the_learner_was_doing() -> None:
    # One rollout alone from 0 to 4 s: training 1-2 s, a weight sync 3-3.5 s, nothing otherwise.
    rec = WorkloadRecorder({"mode": "async"}, clock=CLOCK)
    meter = _begin(rec, 0.0, rec.group_started())
    _phase(rec, 1.0, "train")
    _phase(rec, 2.0, None)
    _phase(rec, 3.0, "sync")
    _phase(rec, 3.5, None)
    _end(rec, 4.0, meter, _episode(8))
    row = rec.workload.rollouts[0]
    assert row.inv == [pytest.approx(4.0 / (1 + c)) for c in OFFSETS]
    assert row.inv_train == [pytest.approx(1.0 / (1 + c)) for c in OFFSETS]
    assert row.inv_sync == [pytest.approx(0.5 / (1 + c)) for c in OFFSETS]


def test_a_record_from_before_the_split_reads_with_no_phases(tmp_path: Path) -> None:
    rec = WorkloadRecorder({"mode": "sync"}, clock=CLOCK)
    _end(rec, 1.0, _begin(rec, 0.0, rec.group_started()), _episode(4))
    path = write_workload(rec.workload, tmp_path / FILE_NAME)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    for line in lines:
        line.pop("inv_train", None)
        line.pop("inv_sync", None)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    row = read_workload(path).rollouts[0]
    assert row.inv_train is None and row.inv_sync is None and row.completion == 4


def test_each_forward_backward_call_records_its_time_beside_rollouts() -> None:
    # A rollout runs from 0 to 4 s; one call trains 1-2 s beside it, one 3.5-5 s half beside it,
    # one 6-7 s alone.
    rec = WorkloadRecorder({"mode": "sync"}, clock=CLOCK)
    meter = _begin(rec, 0.0, rec.group_started())
    _phase(rec, 1.0, "train")
    _phase(rec, 2.0, None)
    rec.trained(10, 1.0)
    _phase(rec, 3.5, "train")
    _end(rec, 4.0, meter, _episode(8))
    _phase(rec, 5.0, None)
    rec.trained(20, 1.5)
    rec.step(1, 5.0, 0.0, 0.0)
    _phase(rec, 6.0, "train")
    _phase(rec, 7.0, None)
    rec.trained(30, 1.0)
    rec.step(2, 7.0, 0.0, 0.0)
    first, second = rec.workload.steps
    assert first.calls == [[10, 1.0, pytest.approx(1.0)], [20, 1.5, pytest.approx(0.5)]]
    assert second.calls == [[30, 1.0, 0.0]] and second.tokens == 30


def test_the_record_reads_the_config_of_its_run(tmp_path: Path) -> None:
    config = _sim_run(tmp_path, "train.total_steps=2", "backend.learner_share=0.5")
    workload = read_workload(tmp_path)
    assert workload.config is not None
    assert workload.config["backend"]["name"] == "sim"
    assert workload.config["backend"]["learner_share"] == 0.5
    assert all(s.calls and sum(c[0] for c in s.calls) == s.tokens for s in workload.steps)
    assert read_workload(config.run_path / FILE_NAME).config == workload.config


def test_the_engines_load_counts_rollouts_in_a_model_call_only() -> None:
    # A two-turn rollout from 0 to 10 s: calls 0-2 s and 6-7 s, its tool between; another
    # rollout's call runs 1-8 s.
    rec = WorkloadRecorder({}, clock=CLOCK)
    agent = _begin(rec, 0.0, rec.group_started())
    other = _begin(rec, 1.0, rec.group_started())
    for now, call in ((2.0, agent.call_ended), (6.0, agent.call_began), (7.0, agent.call_ended)):
        CLOCK.now = now
        call()
    _end(rec, 8.0, other, _episode(3))
    CLOCK.now = 10.0
    rec.finished(agent, _episode(5, turns=2))
    row = next(r for r in rec.workload.rollouts if r.start == 0.0)
    assert row.turns == 2 and row.tool_s == pytest.approx(7.0)  # 10 s, 3 of them in calls
    assert row.active == pytest.approx((1 * 1 + 1 * 2 + 1 * 2) / 3)  # alone 1 s, then with other
    assert row.inv == [pytest.approx(1 / (1 + c) + 2 / (2 + c)) for c in OFFSETS]
    longer = next(r for r in rec.workload.rollouts if r.start == 1.0)
    assert longer.tool_s == pytest.approx(0.0) and longer.active == pytest.approx(9 / 7)


def test_a_runs_time_outside_model_calls_is_recorded_and_the_plan_replays_it(
    tmp_path: Path,
) -> None:
    # On the virtual clock each sim rollout waits `reward_delay_s` after its model call.
    _sim_run(tmp_path, "train.total_steps=2", "workflow.args.reward_delay_s=2.0")
    workload = read_workload(tmp_path)
    assert workload.rollouts
    assert all(r.tool_s == pytest.approx(2.0) for r in workload.rollouts)
    (said,) = [m for m in fit_workload(workload).measured if "outside model calls" in m]
    outside = 2.0 * len(workload.rollouts) / sum(r.end - r.start for r in workload.rollouts)
    assert f"{outside:.0%} of the rollouts' time, replayed per rollout" in said
