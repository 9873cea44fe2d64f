"""UnifiedTrainer behaviour on the virtual clock: steps, timeouts, failures, filtering, sync faults."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest

from rllm_async.callbacks import Callback
from rllm_async.coordinator import StallError, SyncTimeoutError
from rllm_async.health import FailureRateError
from rllm_async.rollout import RolloutContext
from rllm_async.trainer import UnifiedTrainer
from rllm_async.types import Episode
from rllm_async.vclock import run
from rllm_async.workflows.base import Workflow
from tests.fakes import FakeBackend, ScriptedWorkflow, make_config, tasks


def fit(trainer: UnifiedTrainer) -> list[dict[str, float]]:
    return run(trainer.fit(), virtual=True)


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("steps", [1, 7])
def test_total_steps_gives_exactly_that_many_optimizer_steps(tmp_path, mode, steps) -> None:
    backend = FakeBackend(latency=lambda: 0.3, train_s=0.2)
    cfg = make_config(tmp_path, mode=mode, train={"total_steps": steps})
    records = fit(
        UnifiedTrainer(cfg, backend=backend, workflow=ScriptedWorkflow(), train_tasks=tasks(9))
    )
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert len(backend.trained) == steps
    assert backend.policy().version == steps


def test_rollouts_that_never_return_are_reclaimed_at_their_deadline(tmp_path) -> None:
    hang_first_attempt = lambda task, i, attempt: "hang" if i == 0 and attempt == 0 else None  # noqa: E731
    workflow = ScriptedWorkflow(fault=hang_first_attempt)
    backend = FakeBackend(latency=lambda: 0.1)
    cfg = make_config(tmp_path, rollout={"timeout_s": 30.0, "retries": 1, "max_concurrency": 8})
    trainer = UnifiedTrainer(cfg, backend=backend, workflow=workflow, train_tasks=tasks(30))
    records = fit(trainer)
    assert len(records) == 5
    assert sum(r.get("rollout/timeouts", 0) for r in records) >= 5
    # Every timed-out rollout was retried and succeeded, so no group lost a member.
    assert all(len(rewards) == 4 for step in backend.trained for _, rewards in step)
    assert not trainer.coordinator.rollouts_running, "every concurrency slot is free again"
    # Each step waits ~one deadline for its hung rollouts, then goes on.
    assert 30.0 <= records[0]["time/step_s"] < 40.0


def test_workflow_errors_are_retried_then_counted(tmp_path) -> None:
    # Rollout 0 of every task fails on its first attempt only: the retry rescues it.
    workflow = ScriptedWorkflow(fault=lambda t, i, a: "raise" if i == 0 and a == 0 else None)
    backend = FakeBackend()
    cfg = make_config(tmp_path, rollout={"retries": 1})
    records = fit(UnifiedTrainer(cfg, backend=backend, workflow=workflow, train_tasks=tasks(30)))
    assert sum(r.get("rollout/retries", 0) for r in records) >= 20
    assert sum(r.get("rollout/failures", 0) for r in records) == 0
    assert all(len(rewards) == 4 for step in backend.trained for _, rewards in step)


def test_group_trains_on_survivors_or_fails_and_frees_its_slot(tmp_path) -> None:
    # Task t0 loses one rollout (3 of 4 survive >= min 2): it trains on survivors.
    # Task t1 loses three (1 < min 2): the group fails and its slot goes to another task.
    def fault(task, i, attempt):
        if task["id"] == "t0" and i == 0:
            return "raise"
        if task["id"] == "t1" and i in (0, 1, 2):
            return "raise"
        return None

    backend = FakeBackend(latency=lambda: 0.1)
    cfg = make_config(
        tmp_path,
        train={"total_steps": 3, "groups_per_step": 4, "micro_batch_groups": 4},
        rollout={"retries": 0, "min_group_size": 2, "max_failure_rate": 0.9},
        data={"train": {"generator": "tests.fakes:tasks", "args": {"n": 12}, "shuffle": False}},
        coordinator={"pipeline_depth": 0, "max_staleness": 0},
    )
    trainer = UnifiedTrainer(cfg, backend=backend, workflow=ScriptedWorkflow(fault=fault))
    records = fit(trainer)
    trained = {task_id: rewards for step in backend.trained for task_id, rewards in step}
    assert len(trained["t0"]) == 3
    assert "t1" not in trained
    assert sum(r["groups/failed"] for r in records) == 1
    assert [len(step) for step in backend.trained] == [4, 4, 4]


def test_failure_rate_breaker_stops_the_run_with_a_clear_error(tmp_path) -> None:
    workflow = ScriptedWorkflow(fault=lambda t, i, a: "raise" if i < 3 else None)
    cfg = make_config(tmp_path, rollout={"retries": 1, "max_failure_rate": 0.5})
    trainer = UnifiedTrainer(cfg, backend=FakeBackend(), workflow=workflow, train_tasks=tasks(50))
    with pytest.raises(FailureRateError, match=r"75% of the last .* rollouts failed.*injected"):
        fit(trainer)


def test_breaker_tolerates_failures_below_the_rate(tmp_path) -> None:
    workflow = ScriptedWorkflow(fault=lambda t, i, a: "raise" if i == 0 else None)
    cfg = make_config(tmp_path, rollout={"retries": 0, "max_failure_rate": 0.3})
    records = fit(
        UnifiedTrainer(cfg, backend=FakeBackend(), workflow=workflow, train_tasks=tasks(50))
    )
    assert len(records) == 5


def test_zero_variance_filtering_frees_slots_and_the_run_ends_at_the_end_of_data(tmp_path) -> None:
    # Even tasks always get reward 1 (zero variance, filtered); odd tasks get mixed rewards.
    reward = lambda task, i, a: 1.0 if int(task["id"][1:]) % 2 == 0 else float(i % 2)  # noqa: E731
    backend = FakeBackend(latency=lambda: 0.2)
    cfg = make_config(
        tmp_path,
        train={
            "total_steps": 100,
            "total_epochs": 1,
            "groups_per_step": 3,
            "micro_batch_groups": 1,
        },
        coordinator={"pipeline_depth": 0, "max_staleness": 0, "stall_timeout_s": 1000.0},
        checkpoint={"at_end": True},
    )
    trainer = UnifiedTrainer(
        cfg, backend=backend, workflow=ScriptedWorkflow(reward=reward), train_tasks=tasks(20)
    )
    records = fit(trainer)
    trained_ids = [task_id for step in backend.trained for task_id, _ in step]
    assert sorted(trained_ids) == sorted(f"t{i}" for i in range(1, 20, 2))
    assert sum(r["groups/filtered"] for r in records) == 10
    assert [len(s) for s in backend.trained] == [3, 3, 3, 1]  # the last step is partial
    assert (cfg.run_path / "checkpoints" / "step_4").is_dir()


class PartialCreditWorkflow(Workflow):
    """Rollout 0 of tasks t0, t3, t6... is correct; t1, t4... only get partial credit (wrong, with
    varying rewards); t2, t5... are scored without a judgement of correctness."""

    async def run(self, task: dict[str, Any], ctx: RolloutContext) -> Episode:
        await ctx.generate([1, 2, 3])
        kind, first = int(task["id"][1:]) % 3, ctx.rollout_index == 0
        ctx.set_reward(1.0 if kind == 0 and first else 0.1 * first)
        episode = ctx.build_episode(None)
        episode.is_correct = None if kind == 2 else kind == 0 and first
        return episode


@pytest.mark.parametrize("filter_unsolved", [True, False])
def test_filter_unsolved_drops_groups_without_a_correct_rollout(tmp_path, filter_unsolved) -> None:
    backend = FakeBackend()
    cfg = make_config(
        tmp_path,
        train={"total_steps": 100, "total_epochs": 1, "groups_per_step": 2},
        algorithm={"filter_unsolved": filter_unsolved},
    )
    trainer = UnifiedTrainer(
        cfg, backend=backend, workflow=PartialCreditWorkflow(), train_tasks=tasks(12)
    )
    records = fit(trainer)
    trained_ids = {task_id for step in backend.trained for task_id, _ in step}
    unsolved = {f"t{i}" for i in range(1, 12, 3)}
    assert trained_ids == {f"t{i}" for i in range(12)} - (unsolved if filter_unsolved else set())
    filtered = 4 if filter_unsolved else 0
    assert trainer.coordinator.counts.filtered == filtered
    # Groups filtered after the last step's record land in one more record of that step.
    assert sum(r.get("groups/filtered", 0) for r in records) == filtered


class SolvedByKindWorkflow(Workflow):
    """Task `kind` decides its rollouts: all correct, alternating, all wrong, or not judged."""

    async def run(self, task: dict[str, Any], ctx: RolloutContext) -> Episode:
        await ctx.generate([1, 2, 3])
        correct = {"all": True, "half": ctx.rollout_index % 2 == 0, "none": False, "unjudged": None}
        is_correct = correct[task["kind"]]
        ctx.set_reward(float(bool(is_correct)) + 0.1 * ctx.rollout_index)
        episode = ctx.build_episode(None)
        episode.is_correct = is_correct
        return episode


def test_groups_solved_by_every_rollout_or_by_none_are_counted(tmp_path) -> None:
    kinds = ["all"] * 3 + ["half"] * 5 + ["none"] * 2 + ["unjudged"] * 6
    train = [{"id": f"t{i}", "prompt": f"task {i}", "kind": k} for i, k in enumerate(kinds)]
    cfg = make_config(tmp_path, train={"total_steps": 100, "total_epochs": 1})
    trainer = UnifiedTrainer(
        cfg, backend=FakeBackend(), workflow=SolvedByKindWorkflow(), train_tasks=train
    )
    records = fit(trainer)
    assert trainer.coordinator.counts.consumed == 16, (
        "every group has reward variance: none filtered"
    )
    assert sum(r.get("groups/solve_all", 0) for r in records) == 3
    assert sum(r.get("groups/solve_none", 0) for r in records) == 2


@pytest.mark.parametrize("skip_solved", [True, False])
def test_skip_solved_spends_fewer_groups_on_problems_that_are_always_solved(
    tmp_path, skip_solved
) -> None:
    # Two problems every rollout solves, each repeated 20 times under different ids, among 40
    # half-solved ones.
    train = [{"id": f"e{i}", "prompt": f"easy {i % 2}", "kind": "all"} for i in range(40)]
    train += [{"id": f"h{i}", "prompt": f"hard {i}", "kind": "half"} for i in range(40)]
    backend = FakeBackend()
    cfg = make_config(
        tmp_path,
        train={"total_steps": 100, "total_epochs": 1, "groups_per_step": 4},
        algorithm={"skip_solved": skip_solved},
    )
    trainer = UnifiedTrainer(
        cfg, backend=backend, workflow=SolvedByKindWorkflow(), train_tasks=train
    )
    records = fit(trainer)
    trained_ids = {task_id for step in backend.trained for task_id, _ in step}
    assert {f"h{i}" for i in range(40)} <= trained_ids, "every half-solved problem is trained on"
    easy_groups = sum(r.get("groups/solve_all", 0) for r in records)
    skipped = sum(r.get("data/skipped_solved", 0) for r in records)
    if skip_solved:
        assert easy_groups + skipped == 40, "each easy draw is either dispatched or skipped"
        # Each easy problem's 20 draws: served, 1 skipped, served, 2, served, 4, served, 8, served,
        # and the last 4 skipped again.
        assert easy_groups == 2 * 5
    else:
        assert easy_groups == 40
        assert "data/skipped_solved" not in records[0]


def test_sync_hook_that_raises_surfaces_and_generation_resumes(tmp_path) -> None:
    backend = FakeBackend(sync_fault=lambda v: "raise" if v == 2 else None)
    cfg = make_config(tmp_path, coordinator={"sync_retries": 1})
    trainer = UnifiedTrainer(
        cfg, backend=backend, workflow=ScriptedWorkflow(), train_tasks=tasks(30)
    )
    with pytest.raises(RuntimeError, match="injected sync failure at version 2"):
        fit(trainer)
    assert not trainer.coordinator.pause.paused
    assert trainer.coordinator.version == 1


def test_sync_hook_that_fails_once_is_retried(tmp_path) -> None:
    failed: set[int] = set()

    def once(version: int) -> str | None:
        if version == 3 and version not in failed:
            failed.add(version)
            return "raise"
        return None

    backend = FakeBackend(sync_fault=once)
    cfg = make_config(tmp_path, coordinator={"sync_retries": 1})
    records = fit(
        UnifiedTrainer(cfg, backend=backend, workflow=ScriptedWorkflow(), train_tasks=tasks(30))
    )
    assert len(records) == 5


def test_sync_hook_that_hangs_times_out_and_generation_resumes(tmp_path) -> None:
    backend = FakeBackend(sync_fault=lambda v: "hang" if v == 2 else None)
    cfg = make_config(tmp_path, coordinator={"sync_timeout_s": 42.0})
    trainer = UnifiedTrainer(
        cfg, backend=backend, workflow=ScriptedWorkflow(), train_tasks=tasks(30)
    )

    async def timed() -> float:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(SyncTimeoutError, match=r"sync_timeout_s=42\.0"):
            await trainer.fit()
        return loop.time() - t0

    elapsed = run(timed(), virtual=True)
    assert 42.0 <= elapsed < 50.0
    assert not trainer.coordinator.pause.paused


def test_stall_is_reported_with_counts(tmp_path) -> None:
    # The learner never returns from its first forward/backward, so admission never reopens.
    cfg = make_config(tmp_path, coordinator={"stall_timeout_s": 200.0})
    trainer = UnifiedTrainer(
        cfg, backend=FakeBackend(train_s=1e9), workflow=ScriptedWorkflow(), train_tasks=tasks(10)
    )
    with pytest.raises(StallError, match=r"stall_timeout_s=200\.0.*admission.*in_flight"):
        fit(trainer)


class SlowSyncBackend(FakeBackend):
    """A FakeBackend whose weight sync to version `slow_version` takes `slow_s` seconds."""

    def __init__(self, slow_version: int, slow_s: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.slow_version = slow_version
        self.slow_s = slow_s

    async def on_policy_updated(self, version: int) -> None:
        if version == self.slow_version:
            await asyncio.sleep(self.slow_s)
        await super().on_policy_updated(version)


class TwoCallWorkflow(Workflow):
    """Generates, thinks for a while, generates again: the second call may wait for a sync."""

    async def run(self, task: dict[str, Any], ctx: RolloutContext) -> float:
        await ctx.generate([1])
        await asyncio.sleep(3.0)
        await ctx.generate([2])
        return float(ctx.rollout_index % 2)


@pytest.mark.parametrize("depth", [0, 2])
def test_a_sync_longer_than_the_rollout_deadline_loses_no_rollout(tmp_path, depth) -> None:
    # The sync to version 3 takes 590 s, within sync_timeout_s (600 s) but far past the
    # rollouts' 300 s deadline: the rollouts that wait for it are not charged for the wait.
    mode = "sync" if depth == 0 else "async"
    coordinator = {} if depth == 0 else {"pipeline_depth": depth, "max_staleness": depth}
    cfg = make_config(
        tmp_path,
        mode=mode,
        coordinator=coordinator,
        rollout={"timeout_s": 300.0},
        train={"total_steps": 8},
    )
    backend = SlowSyncBackend(3, 590.0, latency=lambda: 5.0)
    trainer = UnifiedTrainer(
        cfg, backend=backend, workflow=TwoCallWorkflow(), train_tasks=tasks(40)
    )
    records = fit(trainer)
    assert len(records) == 8
    assert max(r["time/sync_s"] for r in records) >= 590.0
    for key in ("rollout/timeouts", "rollout/failures", "groups/failed"):
        assert sum(r.get(key, 0) for r in records) == 0, key
    # Only the groups cancelled at the end, counted in the last record, wasted tokens.
    assert sum(r.get("tokens/wasted", 0) for r in records[:-1]) == 0
    assert all(len(rewards) == 4 for step in backend.trained for _, rewards in step)


def test_a_sync_within_its_timeout_is_not_a_stall(tmp_path) -> None:
    # A 450 s sync with a 300 s stall timeout: the sync is progress, not a stall.
    cfg = make_config(
        tmp_path,
        coordinator={"pipeline_depth": 1, "stall_timeout_s": 300.0, "sync_timeout_s": 600.0},
        rollout={"timeout_s": 60.0},
        train={"total_steps": 4},
    )
    backend = SlowSyncBackend(2, 450.0, latency=lambda: 5.0)
    trainer = UnifiedTrainer(
        cfg, backend=backend, workflow=ScriptedWorkflow(), train_tasks=tasks(20)
    )
    records = fit(trainer)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert max(r["time/sync_s"] for r in records) >= 450.0


def test_latest_mode_records_newer_versions_and_pin_never_spans_two(tmp_path) -> None:

    from rllm_async.workflows.base import Workflow

    class TwoCalls(Workflow):
        def __init__(self) -> None:
            self.versions: list[tuple[int, int]] = []

        async def run(self, task, ctx):
            a = await ctx.generate([1])
            await asyncio.sleep(5.0)  # a weight sync happens in between
            b = await ctx.generate([2])
            self.versions.append((a.versions[0], b.versions[0]))
            return float(ctx.rollout_index % 2)

    for mode, spans in (("pin", False), ("latest", True)):
        wf = TwoCalls()
        cfg = make_config(
            tmp_path,
            name=mode,
            coordinator={"pipeline_depth": 2, "max_staleness": 4, "weight_update": mode},
        )
        fit(
            UnifiedTrainer(
                cfg, backend=FakeBackend(train_s=1.0), workflow=wf, train_tasks=tasks(40)
            )
        )
        spanned = any(a != b for a, b in wf.versions)
        assert spanned is spans, mode


@pytest.mark.parametrize("filter_unsolved", [False, True])
def test_a_run_without_any_learning_signal_stops_with_a_clear_error(
    tmp_path, filter_unsolved
) -> None:
    from rllm_async.health import NoSignalError

    workflow = ScriptedWorkflow(reward=lambda task, i, a: 0.0)  # never succeeds
    cfg = make_config(
        tmp_path,
        coordinator={"pipeline_depth": 1},
        algorithm={"filter_unsolved": filter_unsolved},
    )
    trainer = UnifiedTrainer(cfg, backend=FakeBackend(), workflow=workflow, train_tasks=tasks(30))
    fix = "filter_zero_variance=false" + (" or algorithm.filter_unsolved=false" * filter_unsolved)
    with pytest.raises(NoSignalError, match=fix):
        fit(trainer)
    assert trainer.coordinator.counts.filtered >= 40


def test_a_fit_leaves_the_processs_garbage_collector_as_it_found_it(tmp_path) -> None:
    """Collector settings are process-wide: the command that owns the process sets them
    (`rllm-async train`), a library call does not."""
    seen: list[tuple[tuple[int, ...], int]] = []

    class Probe(Callback):
        def on_step_end(self, step, metrics):
            seen.append((gc.get_threshold(), gc.get_freeze_count()))

    before = (gc.get_threshold(), gc.get_freeze_count())
    cfg = make_config(tmp_path, train={"total_steps": 2})
    trainer = UnifiedTrainer(
        cfg,
        backend=FakeBackend(),
        workflow=ScriptedWorkflow(),
        callbacks=[Probe()],
        train_tasks=tasks(8),
    )
    fit(trainer)
    assert seen == [before, before]
    assert (gc.get_threshold(), gc.get_freeze_count()) == before
