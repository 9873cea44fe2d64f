"""A tool agent learning to use its tool, sync and async side by side, on the CPU.

`examples/calculator/workflow.yaml` (the `CalculatorAgent` workflow, the `tiny` local model after
its cached warm start, the partial-credit reward of `rllm_async.tasks.calculator.reward`) trains
once with `mode: sync` and once with `mode: async` (pipeline depth 1, staleness bound 2), the same
seed and steps. Prints one JSON line:
- steps, and per mode: wall_s, step_s, reward_start / reward_end (mean reward of the rollouts that
  ended in the first and last `--window` steps), calls_start / calls_end (well-formed `calc` calls
  per episode, the same windows), correct_end (share of episodes whose answer is the product);
- curve: per `--window` steps, [last step, sync mean reward, async mean reward].

`--config examples/calculator/openai_agent.yaml --modes async` trains the same agent written as a
plain `openai`-client loop through the gateway instead (its JSON line has no curve of the mode
left out).

Usage: python benchmarks/calculator_learning.py [--steps 30] [--window 5] [--config PATH]
       [--modes sync async]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from typing import Any

from rllm_async.config import load_config
from rllm_async.trainer import UnifiedTrainer


def train(config: str, mode: str, steps: int, run_dir: str) -> tuple[list[dict[str, Any]], float]:
    """The run's per-step records and its wall-clock seconds (warm start excluded: it is cached)."""
    overrides = [
        f"name=bench-{mode}",
        f"run_dir={run_dir}",
        f"mode={mode}",
        f"train.total_steps={steps}",
        "eval.every_steps=0",
        "eval.at_end=false",
        "checkpoint.at_end=false",
        "checkpoint.resume=never",
        "logging.progress_bar=false",
    ]
    if mode == "sync":
        overrides += ["coordinator.pipeline_depth=0", "coordinator.max_staleness=0"]
    trainer = UnifiedTrainer(load_config(config, overrides))
    start = time.perf_counter()
    records = trainer.run()
    return records, time.perf_counter() - start


def mean(records: list[dict[str, Any]], key: str) -> float | None:
    """The mean of `key` over the records that have it (a step may complete no rollout); None
    where none has it (the openai-client agent reports no `tool_calls`)."""
    values = [r[key] for r in records if key in r]
    return round(sum(values) / len(values), 4) if values else None


def summary(records: list[dict[str, Any]], wall_s: float, window: int) -> dict[str, float | None]:
    first, last = records[:window], records[-window:]
    return {
        "wall_s": round(wall_s, 1),
        "step_s": round(wall_s / len(records), 2),
        "reward_start": mean(first, "rollout/reward/mean"),
        "reward_end": mean(last, "rollout/reward/mean"),
        "calls_start": mean(first, "episode/tool_calls"),
        "calls_end": mean(last, "episode/tool_calls"),
        "correct_end": mean(last, "episode/correct"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--window", type=int, default=5)
    parser.add_argument("--config", default="examples/calculator/workflow.yaml")
    parser.add_argument("--modes", nargs="+", choices=("sync", "async"), default=["sync", "async"])
    args = parser.parse_args()
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            runs[mode] = train(args.config, mode, args.steps, tmp)
    curve = [
        [
            end,
            *(
                mean(records[end - args.window : end], "rollout/reward/mean")
                for records, _ in runs.values()
            ),
        ]
        for end in range(args.window, args.steps + 1, args.window)
    ]
    out = {
        "steps": args.steps,
        **{mode: summary(records, wall_s, args.window) for mode, (records, wall_s) in runs.items()},
        "curve": curve,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
