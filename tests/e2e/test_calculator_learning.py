"""A tool agent that learns from the calculator task's reward.

The learning test trains the `CalculatorAgent` workflow on the `tiny` preset after its warm start
(which teaches it to copy the tool's result into its answer), once with the real reward and once
with each group's rewards permuted among its rollouts (same rewards, no link to what a rollout
did): the reward rises only with the real one.
"""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from rllm_async import UnifiedTrainer
from rllm_async.algorithms.advantages import grpo
from rllm_async.config import load_config
from rllm_async.health import NoSignalError
from tests.digits import mean_reward

EXAMPLE = Path(__file__).parents[2] / "examples" / "calculator" / "workflow.yaml"
_PERMUTE = random.Random(0)


def permuted_grpo(rewards: Sequence[float], normalize_std: bool = False) -> list[float]:
    """GRPO on the group's rewards permuted among its rollouts: the same rewards, at random."""
    shuffled = list(rewards)
    _PERMUTE.shuffle(shuffled)
    return grpo(shuffled, normalize_std)


def train(tmp_path: Path, name: str, advantage: str) -> list[dict[str, Any]]:
    """`examples/calculator/workflow.yaml` for a few steps; both runs share one warm start, from
    the shared cache (its 1500 steps take about two minutes, once per checkout)."""
    overrides = [
        f"name={name}",
        f"run_dir={tmp_path}",
        f"algorithm.advantage={advantage}",
        # Sync: each step's reward is that of all 64 rollouts of one policy (async steps report
        # the rollouts that ended first, the short guesses before the calls).
        "mode=sync",
        "coordinator.pipeline_depth=0",
        "coordinator.max_staleness=0",
        "algorithm.no_signal_steps=3",
        "train.total_steps=20",
        "data.train.args.n=2000",
        "eval.every_steps=0",
        "eval.at_end=false",
        "checkpoint.resume=never",
        "checkpoint.at_end=false",
        "logging.progress_bar=false",
    ]
    # A permuted run may drift to never calling the tool, until no group has a signal left.
    with contextlib.suppress(NoSignalError):
        UnifiedTrainer(load_config(EXAMPLE, overrides)).run()
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


# Only catches a hang: with a cold warm-start cache, about 150 s on two idle cores and over 600 s
# beside other work (load average 7).
@pytest.mark.timeout(2400)
def test_the_tool_agent_learns_from_the_reward_and_not_from_permuted_rewards(tmp_path) -> None:
    learned = train(tmp_path, "real", "grpo")
    start, end = mean_reward(learned[:3]), mean_reward(learned[-5:])
    _PERMUTE.seed(0)
    shuffled = train(tmp_path, "permuted", "tests.e2e.test_calculator_learning:permuted_grpo")
    s_start, s_end = mean_reward(shuffled[:3]), mean_reward(shuffled[-5:])
    assert end > start + 0.15, (start, end)
    assert s_end < s_start, (s_start, s_end)
    assert end > s_end + 0.3, (end, s_end)
