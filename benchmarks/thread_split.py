"""Seconds per step of a local-backend config under each split of torch threads between the
learner (`backend.threads`) and the sampler (`backend.sampler_threads`), side by side.

The splits run in turn, `--rounds` times over (alternating, so that load drifts hit each alike),
`--steps` optimizer steps each with evaluation and checkpoints off; a run's figure is the time
from its first step's record to its last over the steps between (the first step carries start-up).
Prints one JSON line: per split its seconds per step in each round, their median and spread.

Usage: python benchmarks/thread_split.py [--config examples/smollm2/word_problems.yaml]
           [--splits 1,1 1,2 2,1] [--steps 8] [--rounds 2] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

from rllm_async.config import load_config
from rllm_async.trainer import UnifiedTrainer


def seconds_per_step(
    path: str, learner: int, sampler: int, steps: int, overrides: list[str]
) -> float:
    """One run of `steps` steps under the split; seconds per step after the first."""
    with tempfile.TemporaryDirectory() as tmp:
        config = load_config(
            path,
            [
                *overrides,
                f"run_dir={tmp}",
                "name=split",
                f"backend.threads={learner}",
                f"backend.sampler_threads={sampler}",
                f"train.total_steps={steps}",
                "eval.every_steps=0",
                "eval.at_start=false",
                "eval.at_end=false",
                "checkpoint.every_steps=0",
                "checkpoint.at_end=false",
                "checkpoint.resume=never",
                "logging.progress_bar=false",
            ],
        )
        records = [r for r in UnifiedTrainer(config).run() if "time/step_s" in r]
    first, last = records[0], records[-1]
    return (last["time/elapsed_s"] - first["time/elapsed_s"]) / (len(records) - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="examples/smollm2/word_problems.yaml")
    parser.add_argument("--splits", nargs="+", default=["1,1", "1,2", "2,1"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2: the first step is not counted")
    splits = [tuple(int(n) for n in split.split(",")) for split in args.splits]
    runs: dict[str, list[float]] = {split: [] for split in args.splits}
    for _ in range(args.rounds):
        for name, (learner, sampler) in zip(args.splits, splits, strict=True):
            runs[name].append(
                round(
                    seconds_per_step(args.config, learner, sampler, args.steps, args.overrides), 2
                )
            )
    out = {
        "config": args.config,
        "steps": args.steps,
        "splits": {
            name: {
                "learner_threads": learner,
                "sampler_threads": sampler,
                "s_per_step": times,
                "median": round(statistics.median(times), 2),
                "spread": round(max(times) - min(times), 2),
            }
            for (name, times), (learner, sampler) in zip(runs.items(), splits, strict=True)
        },
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
