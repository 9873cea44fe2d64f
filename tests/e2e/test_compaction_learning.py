"""Trained context compaction on a long-horizon toy env: the tiny model answers `next` six times,
each reply earning the share of its digits; with `compact_at` the conversation is summarized by
the policy whenever its next prompt would pass the budget (each summary a trained step). The same
seeds train with and without compaction, and the run that compacts learns at least as well."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rllm_async import UnifiedTrainer
from rllm_async.config import config_from_dict
from rllm_async.workflows import EnvWorkflow
from tests.digits import digit_fraction, mean_reward

TURNS = 6


class Count:
    """Six turns of `next`; each reply earns its share of digits (of 8 characters), over 6."""

    def reset(self, task: dict[str, Any]) -> str:
        self.turns = 0
        return str(task["prompt"])

    def step(self, action: str) -> tuple[str, float, bool]:
        self.turns += 1
        return "next", digit_fraction({}, action) / TURNS, self.turns >= TURNS


def run(tmp_path: Path, name: str, compact_at: int | None) -> list[dict[str, Any]]:
    config = config_from_dict(
        {
            "name": name,
            "run_dir": str(tmp_path),
            "seed": 0,
            "mode": "sync",
            "backend": {"name": "local", "model": "tiny", "max_batch": 64, "max_seq_len": 64},
            "rollout": {"group_size": 4, "max_tokens": 6, "temperature": 1.0},
            "train": {"total_steps": 40, "groups_per_step": 4, "micro_batch_groups": 4},
            "optim": {"lr": 3e-3},
            "algorithm": {"filter_zero_variance": True},
            "checkpoint": {"resume": "never", "at_end": False},
            "logging": {"progress_bar": False},
        }
    )
    workflow = EnvWorkflow(
        Count,
        max_turns=TURNS,
        compact_at=compact_at,
        compact_prompt="Sum.",
        compact_max_tokens=6,
        summary_template="S:{summary}",
    )
    tasks = [{"id": str(i), "prompt": f"n={i}"} for i in range(200)]
    return UnifiedTrainer(config, workflow=workflow, train_tasks=tasks).run()


def test_a_run_that_compacts_learns_at_least_as_well_as_one_that_does_not(tmp_path: Path) -> None:
    """The same seeds, tasks and context (64 tokens, less than six turns take): without
    compaction a game is cut at the context's end (truncated after 4 turns), with it the policy
    summarizes and plays on. Measured: 0.05 -> 0.49 without, 0.07 -> 0.71 with (and 0.08 -> 0.73
    without compaction when the context is 128 tokens, room for every turn)."""
    plain = run(tmp_path, "plain", None)
    compacted = run(tmp_path, "compacted", 40)
    compactions = [r["episode/compactions"] for r in compacted if "episode/compactions" in r]
    assert len(compactions) == 40 and min(compactions) >= 1  # every step's episodes compacted
    assert all(r["episode/turns"] == TURNS for r in compacted if "episode/turns" in r)
    assert all(r["episode/turns"] < TURNS for r in plain if "episode/turns" in r)
    p_start, p_end = mean_reward(plain[:3]), mean_reward(plain[-4:])
    c_start, c_end = mean_reward(compacted[:3]), mean_reward(compacted[-4:])
    print(f"plain {p_start:.3f} -> {p_end:.3f}; compacted {c_start:.3f} -> {c_end:.3f}")
    assert c_end > c_start + 0.4, (c_start, c_end)
    assert c_end >= p_end, (p_end, c_end)
