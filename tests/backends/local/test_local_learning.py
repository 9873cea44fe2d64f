"""The whole stack learns: async GRPO on the `tiny` preset raises a reward, and shuffled rewards do not.

The task is deliberately easy (answer with digits) so that it fits a CI budget on two CPU cores.
"""

from __future__ import annotations

import random

from rllm_async import SingleTurnWorkflow, UnifiedTrainer
from rllm_async.config import config_from_dict


def digit_fraction(task: dict, text: str) -> float:
    """Dense reward: the share of digits among the reply's first 8 characters."""
    head = text[:8]
    return sum(ch.isdigit() for ch in head) / 8 if head else 0.0


_NOISE = random.Random(0)


def shuffled_reward(task: dict, text: str) -> float:
    """The same reward on a random string of the same length: same scale, no signal."""
    noise = "".join(chr(_NOISE.randint(32, 126)) for _ in range(min(len(text), 8)))
    return digit_fraction(task, noise)


def train(tmp_path, reward, name: str) -> list[dict[str, float]]:
    config = config_from_dict(
        {
            "name": name,
            "run_dir": str(tmp_path),
            "seed": 0,
            "backend": {"name": "local", "model": "tiny", "max_batch": 64, "max_seq_len": 32},
            "rollout": {"group_size": 8, "max_tokens": 8, "temperature": 1.0},
            "coordinator": {"pipeline_depth": 1, "max_staleness": 1},
            "train": {"total_steps": 30, "groups_per_step": 8, "micro_batch_groups": 4},
            "optim": {"lr": 3e-3},
            "algorithm": {"filter_zero_variance": True},
            "checkpoint": {"resume": "never", "at_end": False},
            "logging": {"progress_bar": False},
        }
    )
    trainer = UnifiedTrainer(
        config,
        workflow=SingleTurnWorkflow(reward_fn=reward),
        train_tasks=[{"id": str(i), "prompt": f"n={i}"} for i in range(200)],
    )
    return trainer.run()


def mean_reward(records: list[dict[str, float]]) -> float:
    values = [r["rollout/reward/mean"] for r in records if "rollout/reward/mean" in r]
    return sum(values) / len(values)


def test_reward_rises_with_real_rewards_and_not_with_shuffled_ones(tmp_path) -> None:
    learned = train(tmp_path, digit_fraction, "real")
    start, end = mean_reward(learned[:3]), mean_reward(learned[-5:])
    assert start < 0.3
    assert end > start + 0.4, (start, end)

    shuffled = train(tmp_path, shuffled_reward, "shuffled")
    s_start, s_end = mean_reward(shuffled[:3]), mean_reward(shuffled[-5:])
    assert s_end < s_start + 0.15, (s_start, s_end)
    assert end > s_end + 0.3
