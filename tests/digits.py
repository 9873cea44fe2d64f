"""Learning runs that reward answering in digits, small enough for a CPU or one GPU: the config
they share and the runs themselves, for the end-to-end tests and the GPU tests."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rllm_async import SingleTurnWorkflow, UnifiedTrainer
from rllm_async.config import Config, config_from_dict


def digit_fraction(task: dict[str, Any], text: str) -> float:
    """Dense reward: the share of digits among the reply's first 8 characters."""
    head = text[:8]
    return sum(ch.isdigit() for ch in head) / 8 if head else 0.0


def mean_reward(records: list[dict[str, Any]]) -> float:
    """The mean rollout reward over the records that have one."""
    values = [r["rollout/reward/mean"] for r in records if "rollout/reward/mean" in r]
    return sum(values) / len(values)


def digits_config(
    tmp_path: Path,
    name: str,
    backend: dict[str, Any],
    *,
    total_steps: int = 30,
    groups_per_step: int = 8,
    lr: float = 3e-3,
) -> Config:
    """Async GRPO (one step ahead, staleness at most 1) on the local backend, 8-token replies."""
    return config_from_dict(
        {
            "name": name,
            "run_dir": str(tmp_path),
            "seed": 0,
            "backend": {"name": "local", "max_batch": 64, "max_seq_len": 32, **backend},
            "rollout": {"group_size": 8, "max_tokens": 8, "temperature": 1.0},
            "coordinator": {"pipeline_depth": 1, "max_staleness": 1},
            "train": {
                "total_steps": total_steps,
                "groups_per_step": groups_per_step,
                "micro_batch_groups": 4,
            },
            "optim": {"lr": lr},
            "algorithm": {"filter_zero_variance": True},
            "checkpoint": {"resume": "never", "at_end": False},
            "logging": {"progress_bar": False},
        }
    )


def train(
    config: Config,
    reward: Callable[[dict[str, Any], str], float] = digit_fraction,
    n_tasks: int = 200,
) -> list[dict[str, float]]:
    """The step records of a run of `config` on `n_tasks` prompts, rewarded by `reward`."""
    trainer = UnifiedTrainer(
        config,
        workflow=SingleTurnWorkflow(reward_fn=reward),
        train_tasks=[{"id": str(i), "prompt": f"n={i}"} for i in range(n_tasks)],
    )
    return trainer.run()


def adapters_only_run(tmp_path: Path, **backend: Any) -> list[dict[str, Any]]:
    """The step records of 30 async GRPO steps that train LoRA adapters only, rewarding digits,
    after a warm start that answers in digits or in letters half the time."""
    warm_start = {
        "examples": f"{__name__}:mixed_replies",
        "args": {"n": 200},
        "steps": 50,
        "batch_size": 16,
        "lr": 1e-2,
        "cache_dir": str(tmp_path / "warm_start"),
    }
    lora = {"lora": {"rank": 8, "alpha": 32}, "warm_start": warm_start, **backend}
    return train(digits_config(tmp_path, "lora", lora, lr=1e-2))


def mixed_replies(n: int) -> list[dict[str, Any]]:
    """Transcripts whose replies are all digits or all letters, half and half, for the warm start."""
    rng = random.Random(0)
    examples = []
    for i in range(n):
        chars = "0123456789" if i % 2 else "abcdefghij"
        reply = "".join(rng.choice(chars) for _ in range(8))
        examples.append(
            {
                "messages": [
                    {"role": "user", "content": f"n={i}"},
                    {"role": "assistant", "content": reply},
                ]
            }
        )
    return examples
