"""`coordinator.pipeline_depth: auto`: the depth controller's bounds, convergence and reaction,
and the trainer and config around it."""

from __future__ import annotations

import json
from itertools import pairwise

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rllm_async.backends.sim import workload_config
from rllm_async.config import AutoDepthConfig, ConfigError, CoordinatorConfig
from rllm_async.coordinator import Counts, SyncCoordinator
from rllm_async.plan.simulate import run_workload
from rllm_async.staleness_controller import REASONS, DepthChange, DepthController
from rllm_async.vclock import run
from tests import heavy_tailed
from tests.digits import digits_config, train


def _record(idle: float, gen_idle: float = 0.0, **more: float) -> dict[str, float]:
    return {
        "time/step_s": 10.0,
        "async/trainer_idle_ratio": idle,
        "async/generation_idle_ratio": gen_idle,
        **more,
    }


def _plant(need: int, depth: int) -> dict[str, float]:
    """A workload that keeps the trainer busy from depth `need` on: below it the trainer idles in
    proportion to the missing depth and generation makes that much less; at it and above,
    goodput stays the same and generation waits for admission more the deeper it goes."""
    generated = 1000.0 * min(depth, need) / max(need, 1)
    if depth < need:
        return _record(0.5 * (need - depth) / need, 0.0, **{"tokens/generated": generated})
    return _record(0.0, min(0.9, 0.15 * (depth - need + 1)), **{"tokens/generated": generated})


records = st.fixed_dictionaries(
    {
        "time/step_s": st.floats(0.0, 100.0),
        "async/trainer_idle_ratio": st.floats(0.0, 1.0),
        "async/generation_idle_ratio": st.floats(0.0, 1.0),
        "tokens/wasted": st.floats(0.0, 1e5),
        "tokens/generated": st.floats(0.0, 1e6),
        "groups/dropped_stale": st.floats(0.0, 10.0),
        "groups/consumed": st.floats(0.0, 10.0),
        "staleness/mean": st.floats(0.0, 20.0),
        "rollout/timeouts": st.sampled_from([0.0, 1.0]),
        "loss/sampler_kl": st.floats(0.0, 1.0),
        "loss/num_tokens": st.floats(0.0, 1e5),
    }
)


@given(
    k=st.one_of(st.none(), st.integers(0, 12)),
    sync_every=st.integers(1, 3),
    updates=st.integers(1, 3),
    hold=st.integers(1, 4),
    initial=st.integers(0, 10),
    waste=st.one_of(st.none(), st.floats(0.0, 0.5)),
    steps=st.lists(records, max_size=60),
)
def test_every_decision_stays_within_what_the_hard_bound_allows(
    k, sync_every, updates, hold, initial, waste, steps
) -> None:
    if k is not None and k < sync_every - 1:
        k = sync_every - 1
    config = CoordinatorConfig(
        pipeline_depth="auto",
        max_staleness=k,
        sync_every=sync_every,
        auto=AutoDepthConfig(
            hold_steps=hold, initial=initial, max_waste=waste, max_sampler_kl=waste
        ),
    )
    coord = SyncCoordinator(config, 2, _no_hook, updates_per_batch=updates)
    controller = coord.controller
    assert controller is not None
    last_change = -hold
    for i, record in enumerate(steps):
        change = coord.observe_step(record)
        depth = coord.pipeline_depth
        assert 0 <= depth <= controller.ceiling <= 8
        if k is not None:  # the oldest weights a trained group can come from
            assert depth * updates + sync_every - 1 <= k
        if change is not None:
            assert change.reason in REASONS and change.new == depth != change.old
            assert i - last_change >= hold  # hysteresis
            last_change = i


async def _no_hook(version: int) -> None:
    return None


@settings(max_examples=60)
@given(need=st.integers(0, 8), hold=st.integers(1, 4), initial=st.integers(0, 8))
def test_converges_on_a_stationary_workload(need: int, hold: int, initial: int) -> None:
    controller = DepthController(AutoDepthConfig(hold_steps=hold, initial=initial), ceiling=8)
    for _ in range(200):
        controller.observe(_plant(need, controller.depth))
    settled = controller.depth
    moves = len(controller.changes)
    for _ in range(100):
        controller.observe(_plant(need, controller.depth))
    assert controller.depth == settled and len(controller.changes) == moves  # no more moves
    assert settled >= need  # the trainer is busy
    assert moves <= 2 * 8 + 2  # no oscillation on the way


@settings(max_examples=60)
@given(before=st.integers(0, 4), after=st.integers(0, 8), hold=st.integers(1, 4))
def test_reacts_to_a_step_change_in_lengths_within_bounded_steps(
    before: int, after: int, hold: int
) -> None:
    """Lengths grow at once: the depth that keeps the trainer busy goes from `before` to
    `after`; the trainer is busy again within a bounded number of steps: each move waits a step
    for the pipeline and judges hold_steps, and a move judged on steps from both sides of the
    change may be undone once and retried after retry_steps."""
    config = AutoDepthConfig(hold_steps=hold, retry_steps=10)
    controller = DepthController(config, ceiling=8)
    for _ in range(100):
        controller.observe(_plant(before, controller.depth))
    bound = config.retry_steps + (hold + 1) * 6
    for _ in range(bound):
        if controller.depth >= after:
            break
        controller.observe(_plant(after, controller.depth))
    assert controller.depth >= after, controller.changes


def _after_the_wait(controller: DepthController, record: dict[str, float]) -> DepthChange | None:
    """Observe `record` until the controller judges again after a move; what it did then."""
    for _ in range(20):
        waiting = controller._wait > 0
        change = controller.observe(record)
        if change is not None:
            return change
        if not waiting and controller._since == 0:  # judged, and left the depth
            return None
    raise AssertionError("no judgment in 20 steps")


def test_budgets_lower_the_depth_and_cap_it() -> None:
    config = AutoDepthConfig(hold_steps=1, initial=4, max_waste=0.05, retry_steps=10)
    controller = DepthController(config, 8)
    controller.observe(_record(0.5))  # the first step is not judged
    change = controller.observe(_record(0.5, **{"tokens/wasted": 10.0, "tokens/generated": 100.0}))
    assert change is not None and (change.old, change.new, change.reason) == (4, 3, "waste")
    assert change.metrics() == {"coordinator/depth_change/waste": -1.0}
    assert _after_the_wait(controller, _record(0.5)) is None  # idle, but capped by the budget
    assert controller.depth == 3 and controller.cap == 3
    for _ in range(10):
        controller.observe(_record(0.0))
    assert controller.cap == 8  # the cap lapses after retry_steps
    drops = DepthController(AutoDepthConfig(hold_steps=1, initial=3, max_dropped=0.05), 8)
    drops.observe(_record(0.5))
    change = drops.observe(_record(0.5, **{"groups/dropped_stale": 1.0, "groups/consumed": 9.0}))
    assert change is not None and (change.new, change.reason) == (2, "dropped")
    assert _after_the_wait(drops, _record(0.5, **{"groups/consumed": 10.0})) is None  # capped
    stale = DepthController(AutoDepthConfig(hold_steps=1, initial=2, max_mean_staleness=1.0), 8)
    stale.observe(_record(0.0))
    change = stale.observe(_record(0.0, **{"staleness/mean": 2.0}))
    assert change is not None and change.reason == "staleness" and stale.depth == 1


def test_a_move_up_that_made_things_worse_is_undone_and_retried_later() -> None:
    """Deeper, more groups go over the bound and are dropped: less goodput, the trainer no
    busier. The move up is undone, and tried again only after retry_steps, doubled for each
    trial undone in a row."""
    config = AutoDepthConfig(hold_steps=2, initial=1, retry_steps=12)
    controller = DepthController(config, 8)
    shallow = _record(0.4, **{"tokens/generated": 1000.0})
    deep = _record(0.45, **{"tokens/generated": 1000.0, "tokens/wasted": 200.0})
    moves = []
    for _ in range(120):
        change = controller.observe(shallow if controller.depth <= 1 else deep)
        if change is not None:
            moves.append((controller._steps, change.old, change.new, change.reason))
    assert moves[0][1:] == (1, 2, "trainer_idle") and moves[1][1:] == (2, 1, "worse")
    retries = [step for step, old, new, _ in moves if new > old]
    gaps = [b - a for a, b in pairwise(retries)]
    assert len(gaps) >= 2  # explored again once the limit lapsed (the workload may drift)
    assert gaps[0] > config.retry_steps and gaps[1] > 2 * config.retry_steps
    assert controller.depth == 1 or moves[-1][3] == "trainer_idle"


def test_a_move_down_that_left_the_trainer_idle_is_undone() -> None:
    """Generation idles at depth 2 with the trainer busy, so the controller tries 1; there the
    trainer starves: back to 2, and no lower for retry_steps."""
    config = AutoDepthConfig(hold_steps=1, initial=2, retry_steps=15)
    controller = DepthController(config, 8)
    busy = _record(0.0, 0.5, **{"tokens/generated": 1000.0})
    starved = _record(0.3, 0.0, **{"tokens/generated": 700.0})
    moves = []
    for _ in range(15):
        change = controller.observe(starved if controller.depth < 2 else busy)
        if change is not None:
            moves.append((controller._steps, change.old, change.new, change.reason))
    assert [m[1:] for m in moves] == [(2, 1, "generation_idle"), (1, 2, "worse")]
    assert controller.floor == 2 and controller.depth == 2


def test_the_ceiling_is_what_max_staleness_allows() -> None:
    auto = {"pipeline_depth": "auto"}
    assert CoordinatorConfig(**auto, max_staleness=None).depth_ceiling(1) == 8
    assert CoordinatorConfig(**auto, max_staleness=3).depth_ceiling(1) == 3
    assert CoordinatorConfig(**auto, max_staleness=5, sync_every=2).depth_ceiling(2) == 2
    assert CoordinatorConfig(pipeline_depth=5, max_staleness=None).depth_ceiling(2) == 5
    config = workload_config("W1", ["coordinator.pipeline_depth=auto"])
    assert config.coordinator.pipeline_depth == "auto"
    with pytest.raises(ConfigError, match="max_staleness"):
        workload_config(
            "W1",
            [
                "coordinator.pipeline_depth=auto",
                "coordinator.max_staleness=0",
                "coordinator.sync_every=2",
            ],
        )
    with pytest.raises(ConfigError):
        workload_config("W1", ["coordinator.pipeline_depth=deep"])


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(s=heavy_tailed.schedules(), hold=st.integers(1, 2))
def test_auto_keeps_the_hard_bound_through_training(tmp_path, s: dict, hold: int) -> None:
    coordinator = {"pipeline_depth": "auto", "auto": {"hold_steps": hold, "max_depth": 3}}
    trainer, backend = heavy_tailed.trainer(tmp_path, s, {}, coordinator)

    def check(name: str, c: Counts) -> None:
        coord = trainer.coordinator
        assert coord.pipeline_depth <= min(3, s["k"])
        limit = (coord.version + coord.pipeline_depth + 1) * s["gps"]
        assert c.consumed + c.in_flight + c.buffered <= limit or name != "dispatched"

    trainer.coordinator.on_event = check
    records = run(trainer.fit(), virtual=True)
    assert len(records) == 6
    assert backend.staleness and max(backend.staleness) <= s["k"]
    assert all("coordinator/pipeline_depth" in r for r in records)
    controller = trainer.coordinator.controller
    assert controller is not None
    recorded = [k for r in records for k in r if k.startswith("coordinator/depth_change/")]
    assert len(recorded) == len([c for step, c in controller.changes if step < len(records)])


def test_auto_on_a_drifting_sim_workload_keeps_the_bound() -> None:
    out = run_workload(
        "D1",
        [
            "mode=async",
            "coordinator.pipeline_depth=auto",
            "coordinator.max_staleness=8",
            "train.total_steps=12",
            "coordinator.auto.hold_steps=1",
        ],
    )
    assert out["steps"] == 12 and out["violations"] == 0 and out["staleness_max"] <= 8


def test_auto_deepens_within_a_kl_budget_as_the_policy_slows() -> None:
    """D4: the KL a version of staleness brings falls 10x over 60 steps. d = 2 exceeds the
    budget early on, so d = 1 is the fastest fixed depth within it; auto keeps the budget over
    every 10 steps and, going deeper as the KL per version falls, ends sooner."""
    budget = workload_config("D4").coordinator.auto.max_sampler_kl
    common = ["mode=async", "coordinator.max_staleness=null", "train.total_steps=60"]
    fixed = {d: run_workload("D4", [*common, f"coordinator.pipeline_depth={d}"]) for d in (1, 2)}
    auto = run_workload("D4", [*common, "coordinator.pipeline_depth=auto"])
    assert budget is not None
    assert fixed[1]["sampler_kl_peak"] <= budget < fixed[2]["sampler_kl_peak"]
    assert 0 < auto["sampler_kl_peak"] <= budget
    assert auto["time_s"] < 0.95 * fixed[1]["time_s"]


def test_fixed_depths_record_no_controller_metrics(tmp_path) -> None:
    s = {"d": 1, "k": 2, "gps": 2, "group_size": 2, "alpha": 2.0, "scale": 0.1}
    trainer, _ = heavy_tailed.trainer(tmp_path, {**s, "train_s": 0.5, "seed": 1}, {}, {})
    records = run(trainer.fit(), virtual=True)
    assert trainer.coordinator.controller is None
    assert not any(key.startswith("coordinator/") for r in records for key in r)


def test_simulate_takes_auto_from_the_command_line(capsys) -> None:
    from rllm_async.cli import main

    small = ["train.groups_per_step=8", "backend.slots=64", "rollout.max_concurrency=64"]
    argv = ["simulate", "--workload", "D2", "--pipeline-depth", "auto", "--max-staleness", "4"]
    assert main([*argv, "--steps", "4", "--json", "--set", *small]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["pipeline_depth"], out["max_staleness"], out["violations"]) == ("auto", 4, 0)


def test_the_sampler_kl_budget_is_the_token_weighted_kl_of_the_judged_steps() -> None:
    config = AutoDepthConfig(hold_steps=2, initial=3, max_sampler_kl=0.01)
    controller = DepthController(config, 8)
    controller.observe(_record(0.0))
    # 0.03 over 100 tokens and 0.0 over 900: 0.003 on the mean, within the budget.
    for kl, tokens in ((0.03, 100.0), (0.0, 900.0)):
        record = _record(0.0, **{"loss/sampler_kl": kl, "loss/num_tokens": tokens})
        assert controller.observe(record) is None
    controller.observe(_record(0.0, **{"loss/sampler_kl": 0.02, "loss/num_tokens": 500.0}))
    change = controller.observe(_record(0.0, **{"loss/sampler_kl": 0.01, "loss/num_tokens": 500.0}))
    assert change is not None and (change.old, change.new, change.reason) == (3, 2, "sampler_kl")


def test_auto_on_the_local_backend_keeps_a_sampler_kl_budget(tmp_path) -> None:
    """A real run (the local backend's tiny model): stale groups are sampled by weights the
    learner has moved on from, so their KL is above a zero budget and the depth goes down."""
    config = digits_config(tmp_path, "auto", {"model": "tiny"}, total_steps=8, groups_per_step=4)
    auto = {"initial": 2, "hold_steps": 1, "max_sampler_kl": 0.0}
    config.coordinator = CoordinatorConfig(pipeline_depth="auto", max_staleness=2, auto=auto)
    records = train(config)
    depths = [r["coordinator/pipeline_depth"] for r in records]
    assert len(records) == 8 and depths[0] == 2
    assert all(b <= a for a, b in pairwise(depths))  # capped by the budget: it never goes up
    assert all(r["staleness/max"] <= 2 for r in records if "staleness/max" in r)
    changes = [(k, v) for r in records for k, v in r.items() if "depth_change" in k]
    assert changes and changes[0] == ("coordinator/depth_change/sampler_kl", -1.0)
    assert any(r["loss/sampler_kl"] > 0 for r in records[1:])


def test_groups_over_the_bound_while_the_trainer_idles_lower_the_depth() -> None:
    """Generation-bound with groups dropped as too stale: one lower, and no higher while that is
    judged; with hung rollouts among them (timeouts), the drops are not the depth's doing."""
    config = AutoDepthConfig(hold_steps=1, initial=3, retry_steps=10)
    late = {"groups/dropped_stale": 2.0, "groups/consumed": 14.0, "tokens/generated": 1000.0}
    controller = DepthController(config, 8)
    controller.observe(_record(0.5))
    change = controller.observe(_record(0.5, **late))
    assert change is not None and (change.old, change.new, change.reason) == (3, 2, "over_bound")
    assert _after_the_wait(controller, _record(0.5, **{"tokens/generated": 1000.0})) is None
    assert controller.depth == 2 and controller.cap == 2  # idle, but not back up yet
    hung = DepthController(config, 8)
    hung.observe(_record(0.5))
    change = hung.observe(_record(0.5, **late, **{"rollout/timeouts": 1.0}))
    assert change is not None and (change.new, change.reason) == (6, "trainer_idle")


def test_a_difference_within_the_steps_noise_does_not_undo_a_move() -> None:
    """Two depths whose goodput differs by 5% on the mean, with steps that vary by 30%: the move
    down stands; the same 5% with steady steps undoes it."""
    config = AutoDepthConfig(hold_steps=1, initial=2, retry_steps=40)

    def moves(noise: float) -> list[tuple[int, int, str]]:
        controller = DepthController(config, 8)
        out = []
        for i in range(40):
            scale = 1.0 + (noise if i % 2 else -noise)
            goodput = 1000.0 if controller.depth >= 2 else 950.0
            gen_idle = 0.5 if controller.depth >= 2 and i >= 8 else 0.0  # from step 9 on
            change = controller.observe(
                _record(0.0, gen_idle, **{"tokens/generated": goodput * scale})
            )
            if change is not None:
                out.append((change.old, change.new, change.reason))
        return out

    assert moves(0.3) == [(2, 1, "generation_idle")]
    assert moves(0.0) == [(2, 1, "generation_idle"), (1, 2, "worse")]


def test_a_move_down_for_groups_over_the_bound_is_undone_where_it_gave_less_on_the_mean() -> None:
    """Groups go over the bound at d = 2 while the trainer idles: d = 1. Its steps vary by 30%,
    so a 5% loss is within their noise; but the move's premise, that fewer rollouts at once
    lose fewer groups and so give more, failed over a whole stay: back to 2, and not below it
    again. Where d = 1 gives more, the move stands until its limit lapses."""
    config = AutoDepthConfig(hold_steps=1, initial=2, retry_steps=40)

    def moves(low: float) -> list[tuple[int, int, str]]:
        controller = DepthController(config, 2)
        out = []
        for i in range(50):
            scale = 1.0 + (0.3 if i % 2 else -0.3)
            more: dict[str, float] = {
                "tokens/generated": (1000.0 if controller.depth == 2 else low)
            }
            more["tokens/generated"] *= scale
            if controller.depth == 2 and i >= 8:  # from step 9 on, groups go over the bound
                more |= {"groups/dropped_stale": 2.0, "groups/consumed": 14.0}
            change = controller.observe(_record(0.5, **more))  # generation-bound throughout
            if change is not None:
                out.append((change.old, change.new, change.reason))
        return out

    assert moves(950.0) == [(2, 1, "over_bound"), (1, 2, "worse")]
    assert moves(1050.0)[:2] == [(2, 1, "over_bound"), (1, 2, "trainer_idle")]


def test_an_undone_move_down_for_groups_over_the_bound_counts_one_failure_not_two() -> None:
    """d = 2 drops groups while the trainer idles: d = 1, counted as a failed trial of 2. d = 1
    gives less over a whole stay: back to 2, and the undo shows that 2 had not failed, so the
    floor it sets holds `retry_steps`, as after one failed move; it does not double. Once it
    lapses, the groups still going over the bound at d = 2 move it down again."""
    config = AutoDepthConfig(hold_steps=1, initial=2, retry_steps=20)
    controller = DepthController(config, 2)
    moves = []
    for i in range(80):
        scale = 1.0 + (0.3 if i % 2 else -0.3)
        more: dict[str, float] = {
            "tokens/generated": (1000.0 if controller.depth == 2 else 950.0) * scale
        }
        if controller.depth == 2 and i >= 8:  # from step 9 on, groups go over the bound
            more |= {"groups/dropped_stale": 2.0, "groups/consumed": 14.0}
        change = controller.observe(_record(0.5, **more))  # generation-bound throughout
        if change is not None:
            moves.append((controller._steps, change.old, change.new, change.reason))
    assert [m[1:] for m in moves[:3]] == [
        (2, 1, "over_bound"),
        (1, 2, "worse"),
        (2, 1, "over_bound"),
    ]
    undone_at, again_at = moves[1][0], moves[2][0]
    assert config.retry_steps <= again_at - undone_at <= config.retry_steps + 1


def test_a_move_down_for_groups_over_the_bound_after_a_short_stay_is_not_judged_on_its_mean() -> (
    None
):
    """d = 2 is tried, and its first judged step drops groups over the bound: back to 1. That one
    step happened to be a good one (1300 against 1000 on the mean of d = 1's steps); a mean of
    fewer than half a stay's steps is noise, so the move down stands and d = 2 is tried again
    once its limit lapses (`retry_steps`), instead of being held there."""
    config = AutoDepthConfig(hold_steps=1, initial=1, retry_steps=20)
    controller = DepthController(config, 2)
    moves = []
    for i in range(40):
        more: dict[str, float] = {"tokens/generated": 1300.0 if i % 2 else 700.0}
        if controller.depth == 2:
            more = {
                "tokens/generated": 1300.0,
                "groups/dropped_stale": 2.0,
                "groups/consumed": 14.0,
            }
        change = controller.observe(_record(0.5, **more))  # generation-bound throughout
        if change is not None:
            moves.append((change.old, change.new, change.reason))
    assert moves[:3] == [(1, 2, "trainer_idle"), (2, 1, "over_bound"), (1, 2, "trainer_idle")]


def test_a_depth_that_keeps_sending_groups_over_the_bound_is_tried_less_and_less_often() -> None:
    """A tight bound: at d = 1 the trainer idles a little and nothing is lost; at d = 2 a
    quarter of the groups go over the bound. Each trial of d = 2 is a failed one, so the next
    waits twice as long (`retry_steps`, then 2x, then 4x)."""
    config = AutoDepthConfig(hold_steps=1, initial=1, retry_steps=10)
    controller = DepthController(config, 2)
    shallow = _record(0.1, **{"tokens/generated": 1000.0, "groups/consumed": 16.0})
    deep = _record(  # the same goodput as d = 1: neither move is undone as worse
        0.1,
        **{
            "tokens/generated": 1250.0,
            "tokens/wasted": 250.0,
            "groups/dropped_stale": 4.0,
            "groups/consumed": 12.0,
        },
    )
    trials = []
    for _ in range(120):
        change = controller.observe(deep if controller.depth == 2 else shallow)
        if change is not None:
            assert change.reason in ("trainer_idle", "over_bound")
            if change.new == 2:
                trials.append(controller._steps)
    gaps = [b - a for a, b in pairwise(trials)]
    assert len(gaps) >= 3
    assert gaps[0] > config.retry_steps
    assert gaps[1] > 2 * config.retry_steps and gaps[2] > 4 * config.retry_steps


def test_hung_rollouts_lift_the_limit_that_groups_over_the_bound_set() -> None:
    """Groups over the bound at d = 3: d = 2, no higher for now. Then rollouts hang and the
    trainer idles at d = 2: a shallow pipeline stalls behind them, so the limit goes and d
    goes up; without the hung rollouts it holds."""
    config = AutoDepthConfig(hold_steps=1, initial=3, retry_steps=20)
    late = {"groups/dropped_stale": 2.0, "groups/consumed": 14.0, "tokens/generated": 1000.0}

    def after(record: dict[str, float]) -> DepthChange | None:
        controller = DepthController(config, 8)
        controller.observe(_record(0.5))
        change = controller.observe(_record(0.5, **late))
        assert change is not None and (change.new, change.reason) == (2, "over_bound")
        return _after_the_wait(controller, record)

    idle = {"tokens/generated": 1000.0, "groups/consumed": 16.0}
    assert after(_record(0.5, **idle)) is None
    change = after(_record(0.5, **idle, **{"rollout/timeouts": 1.0}))
    assert change is not None and (change.old, change.new, change.reason) == (2, 4, "trainer_idle")


@pytest.mark.parametrize(
    ("budget", "expected"),
    [(None, 4), (0.012, 4), (0.0095, 3), (0.0085, None)],
)
def test_a_move_up_goes_no_deeper_than_the_kl_budget_predicts(
    budget: float | None, expected: int | None
) -> None:
    """An idle trainer at depth 2, staleness 2 and KL 0.006: each depth deeper adds a version of
    staleness and KL in proportion (0.009 at 3, 0.012 at 4); the move stops where the budget
    would be exceeded, and is not made where even one deeper would be."""
    controller = DepthController(AutoDepthConfig(hold_steps=2, initial=2, max_sampler_kl=budget), 8)
    controller.observe(_record(0.0))
    more = {"staleness/mean": 2.0, "loss/sampler_kl": 0.006, "loss/num_tokens": 100.0}
    assert controller.observe(_record(0.5, **more)) is None
    change = controller.observe(_record(0.5, **more))  # idle over 4x the target: doubling
    assert (change and change.new) == expected
    assert change is None or change.reason == "trainer_idle"


def test_a_move_up_goes_no_deeper_than_the_staleness_budget_predicts() -> None:
    config = AutoDepthConfig(hold_steps=2, initial=2, max_mean_staleness=3.5)
    controller = DepthController(config, 8)
    controller.observe(_record(0.0))
    for _ in range(2):
        change = controller.observe(_record(0.5, **{"staleness/mean": 2.0}))
    assert change == DepthChange(2, 3, "trainer_idle")
