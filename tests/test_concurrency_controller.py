"""`rollout.max_concurrency: auto`: the limit that keeps the engine's decode slots full, its
measurements, where it starts, and runs on the sim and local backends that move it."""

from __future__ import annotations

import asyncio
import math
from itertools import pairwise
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rllm_async.backends.sim import SimBackend, workload_config
from rllm_async.concurrency_controller import (
    BAND,
    HOLD_STEPS,
    ConcurrencyController,
    ModelClock,
    starting_concurrency,
)
from rllm_async.config import ConfigError, CoordinatorConfig
from rllm_async.coordinator import SyncCoordinator
from rllm_async.plan.simulate import QUIET
from rllm_async.rollout_slots import RolloutSlots
from rllm_async.trainer import UnifiedTrainer
from rllm_async.vclock import run
from tests.digits import digits_config, train


def _sim(tmp_path: Path, overrides: list[str]) -> list[dict[str, float]]:
    """The records of a W1 run on the sim backend's virtual clock, with `overrides`."""
    config = workload_config("W1", [f"run_dir={tmp_path}", *QUIET, *overrides])
    return run(UnifiedTrainer(config).fit(), virtual=True)


def _step(model_s: float, wall_s: float) -> dict[str, float]:
    return {"rollout/model_s": model_s, "rollout/wall_s": wall_s}


@given(slots=st.integers(1, 512), percent=st.integers(1, 100), steps=st.integers(2, 40))
def test_the_limit_is_the_slots_over_the_share_of_time_in_model_calls(
    slots: int, percent: int, steps: int
) -> None:
    """Whole seconds of model time a step, so that the share the controller sums over its steps
    is exactly `percent` / 100 (a float share summed over steps may round across a ceiling)."""
    controller = ConcurrencyController(slots)
    for _ in range(steps):
        controller.observe(_step(float(percent), 100.0))
    target = max(slots, math.ceil(slots / (percent / 100)))
    assert controller.limit >= slots
    assert abs(controller.limit - target) <= BAND * controller.limit  # within the band, moved once


def test_it_moves_at_most_every_hold_steps_and_not_within_the_band() -> None:
    controller = ConcurrencyController(100)
    assert controller.observe(_step(50.0, 100.0)) is None  # one step: not yet judged
    change = controller.observe(_step(50.0, 100.0))
    assert change is not None and (change.old, change.new, change.model_share) == (100, 200, 0.5)
    assert change.metrics() == {
        "rollout/max_concurrency_change": 100.0,
        "rollout/model_share": 0.5,
    }
    for _ in range(HOLD_STEPS):  # 100 / 0.45 = 223: within 20% of 200
        last = controller.observe(_step(45.0, 100.0))
    assert last is None and controller.limit == 200
    for _ in range(HOLD_STEPS):  # all the time in model calls: back to the slots
        last = controller.observe(_step(100.0, 100.0))
    assert last is not None and controller.limit == 100


def test_steps_in_which_no_rollout_ended_change_nothing() -> None:
    controller = ConcurrencyController(64)
    for _ in range(3 * HOLD_STEPS):
        assert controller.observe({}) is None
    assert controller.limit == 64


def test_the_model_clock_counts_overlapping_calls_once() -> None:
    class Inner:
        calls = 0

        def call_began(self) -> None:
            self.calls += 1

        def call_ended(self) -> None:
            self.calls -= 1

    async def scenario() -> dict[str, float]:
        inner = Inner()
        clock = ModelClock(inner, asyncio.get_running_loop())
        await asyncio.sleep(1.0)  # a tool
        clock.call_began()
        await asyncio.sleep(2.0)
        clock.call_began()  # a second call beside the first
        await asyncio.sleep(1.0)
        clock.call_ended()
        assert inner.calls == 1  # the inner meter hears of every call
        await asyncio.sleep(1.0)
        clock.call_ended()
        await asyncio.sleep(3.0)
        return clock.metrics()

    assert run(scenario(), virtual=True) == {"rollout/model_s": 4.0, "rollout/wall_s": 8.0}


def test_a_raised_limit_starts_the_rollouts_waiting_at_once() -> None:
    async def scenario() -> None:
        config = CoordinatorConfig(pipeline_depth=0, max_staleness=None)
        coord = SyncCoordinator(config, groups_per_step=1, on_policy_updated=lambda v: None)
        slots = RolloutSlots(1, None, coord)
        await slots.acquire()
        waiting = [asyncio.ensure_future(slots.acquire()) for _ in range(3)]
        await asyncio.sleep(0)
        assert not any(w.done() for w in waiting)
        slots.set_max_concurrency(3)
        await asyncio.sleep(0)
        assert [w.done() for w in waiting] == [True, True, False] and slots.running == 3

    run(scenario(), virtual=True)


def test_auto_starts_at_the_engines_decode_slots_and_refuses_a_backend_that_cannot_tell(
    tmp_path,
) -> None:
    config = workload_config("W1", ["rollout.max_concurrency=auto", "backend.slots=96"])
    assert starting_concurrency(config, SimBackend.from_config(config)) == 96
    assert starting_concurrency(workload_config("W1", []), object()) == 512  # a number stays
    with pytest.raises(ConfigError, match=r"max_concurrency: auto .* set rollout.max_concurrency"):
        starting_concurrency(config, object())


def test_on_a_sim_workload_with_tool_time_the_limit_rises_to_fill_the_engine(tmp_path) -> None:
    """Each rollout decodes, then waits 30 s for a tool: 512 of them at once keep well under 512
    sequences decoding, so the limit rises, to about 512 over the measured share."""
    overrides = [
        "rollout.max_concurrency=auto",
        "workflow.args.tool_s=30",
        "coordinator.pipeline_depth=4",
        "coordinator.max_staleness=null",
        "train.total_steps=16",
    ]
    records = _sim(tmp_path, overrides)
    limits = [r["rollout/max_concurrency"] for r in records]
    assert len(records) == 16 and limits[0] == 512 and limits[-1] > 1.2 * 512
    assert all(b >= a for a, b in pairwise(limits))  # a stationary workload: only up
    changes = [r for r in records if "rollout/max_concurrency_change" in r]
    assert changes and all(0.0 < r["rollout/model_share"] < 1.0 for r in changes)
    assert limits[-1] == math.ceil(512 / changes[-1]["rollout/model_share"])


def test_fixed_concurrency_records_no_controller_metrics(tmp_path) -> None:
    records = _sim(tmp_path, ["train.total_steps=3"])
    assert len(records) == 3
    controller = ("rollout/max_concurrency", "rollout/model_")
    assert not any(key.startswith(controller) for r in records for key in r)


def test_auto_on_the_local_backend_starts_at_the_samplers_batch(tmp_path) -> None:
    """A real run (the local backend's tiny model): the limit starts at `max_batch` and every
    step's record carries it and the rollouts' time in model calls."""
    config = digits_config(tmp_path, "auto", {"model": "tiny"}, total_steps=4, groups_per_step=4)
    config.rollout.max_concurrency = "auto"
    records = train(config)
    assert len(records) == 4 and records[0]["rollout/max_concurrency"] == 64
    # Single-turn rollouts are all model call: the share stays at 1 and the limit at the slots.
    assert all(r["rollout/max_concurrency"] == 64 for r in records)
    assert all(0.0 < r["rollout/model_s"] <= r["rollout/wall_s"] for r in records)
