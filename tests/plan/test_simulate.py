"""`rllm-async simulate` (`rllm_async.plan.simulate`): sim runs through the real trainer on the
virtual clock, and the figures it reports of them."""

from __future__ import annotations

from typing import Any

import pytest

from rllm_async.config import ConfigError
from rllm_async.plan.simulate import run_workload, simulate

# W1 at a quarter of its size: 8 groups of 8 per step on 64 decode slots, trained 4 groups at a
# time (`train.micro_batch_groups`' default), so that streaming sync differs from classic sync.
STEPS = 6
SMALL = ["train.groups_per_step=8", "backend.slots=64", "rollout.max_concurrency=64"]
ASYNC = ["mode=async", "coordinator.pipeline_depth=2"]


def _run(*overrides: str) -> dict[str, Any]:
    return run_workload("W1", [f"train.total_steps={STEPS}", *SMALL, *overrides])


def _consistent(out: dict[str, Any]) -> None:
    """What holds of any run's figures."""
    assert out["steps"] == STEPS
    assert 0.0 < out["first_step_s"] < out["time_s"]
    # No run is faster than generating its trained tokens at the full decode rate, or than
    # its learner's own time.
    assert 0.0 < out["t_ideal_s"] <= out["time_s"]
    assert 0.0 <= out["waste_steady"] < 1.0 and 0.0 <= out["waste"] < 1.0
    assert out["staleness_p50"] <= out["staleness_p90"] <= out["staleness_max"]
    assert 0.0 <= out["staleness_mean"] <= out["staleness_max"]
    assert 0.0 <= out["trainer_idle_ratio"] <= 1.0


def test_an_async_run_keeps_its_staleness_bound() -> None:
    out = _run(*ASYNC, "coordinator.max_staleness=2")
    _consistent(out)
    assert out["staleness_max"] <= 2 and out["violations"] == 0
    unbounded = _run(*ASYNC, "coordinator.max_staleness=null")
    _consistent(unbounded)
    assert unbounded["violations"] == 0 and unbounded["dropped_stale"] == 0
    assert unbounded["staleness_max"] > 2  # the bound above was binding


def test_a_sync_run_trains_every_group_on_the_policy_that_generated_it() -> None:
    out = _run("mode=sync")
    _consistent(out)
    assert out["staleness_max"] == 0 and out["violations"] == 0
    assert out["waste"] == 0.0 and out["dropped_stale"] == 0


def test_a_run_on_the_virtual_clock_is_reproducible_and_depends_on_the_seed() -> None:
    def figures(out: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in out.items() if k != "wall_s"}  # the only real-time figure

    bounded = [*ASYNC, "coordinator.max_staleness=2"]
    first = figures(_run(*bounded, "seed=3"))
    assert figures(_run(*bounded, "seed=3")) == first
    assert figures(_run(*bounded, "seed=4"))["time_s"] != first["time_s"]


def test_simulate_compares_the_setting_with_both_sync_baselines() -> None:
    out = simulate("W1", pipeline_depth=2, max_staleness=2, steps=STEPS, overrides=SMALL)
    assert (out["mode"], out["pipeline_depth"], out["max_staleness"]) == ("async", 2, 2)
    # Streaming sync trains a step's first micro-batches beside its last rollouts.
    assert out["t_sync_streaming_s"] < out["t_sync_s"]
    # W1 is dominated by generation: two steps ahead, async is faster than either sync.
    assert out["t_async_s"] < out["t_sync_streaming_s"]
    assert out["speedup"] == pytest.approx(out["t_sync_s"] / out["t_async_s"], abs=1e-3)
    assert out["speedup_vs_streaming_sync"] == pytest.approx(
        out["t_sync_streaming_s"] / out["t_async_s"], abs=1e-3
    )
    assert out["efficiency"] == pytest.approx(out["t_ideal_s"] / out["t_async_s"], abs=1e-3)
    assert out["staleness_max"] <= 2 and out["violations"] == 0
    # Tested in sync mode, the setting is the streaming baseline itself, run again.
    same = simulate("W1", mode="sync", steps=STEPS, overrides=SMALL)
    assert (same["pipeline_depth"], same["max_staleness"]) == (0, 0)
    assert same["t_async_s"] == same["t_sync_streaming_s"] == out["t_sync_streaming_s"]
    assert same["speedup_vs_streaming_sync"] == 1.0


def test_an_unknown_workload_is_refused() -> None:
    with pytest.raises(ConfigError, match="unknown sim workload 'W9'"):
        run_workload("W9", [])
