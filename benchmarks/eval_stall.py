"""What held-out evaluation costs the training loop of the main job, with and without it.

Runs the countdown main job (`examples/countdown/local_async.yaml`, or `--config`) twice in one
process, one after the other: `--steps` steps with no evaluation, then the same with one every
`--every` steps (no evaluation at the start or end, no checkpoints). For each it reports, from
the step records:
- loop_wait_s: time the training loop spent between steps (the wall time no step's
  `time/step_s` covers), where it would wait for an evaluation;
- trainer_idle_s: time the trainer waited for groups (`async/trainer_idle_s`), which grows when
  evaluation rollouts take the sampler's time from training rollouts;
- s_per_step and wall_s; for the evaluated run, the evaluations that landed and their versions.

Prints one JSON line. Usage: python benchmarks/eval_stall.py [--steps 100] [--every 10]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from rllm_async.config import load_config
from rllm_async.trainer import UnifiedTrainer

MAIN_JOB = Path(__file__).resolve().parent.parent / "examples" / "countdown" / "local_async.yaml"


def measure(config: Path, steps: int, every: int, run_dir: str, mode: str) -> dict[str, Any]:
    """Train `steps` steps, evaluating every `every` (0: never); the loop's waits and idle time."""
    cfg = load_config(
        config,
        [
            f"mode={mode}",
            f"train.total_steps={steps}",
            f"eval.every_steps={every}",
            "eval.at_start=false",
            "eval.at_end=false",
            "checkpoint.every_steps=0",
            "checkpoint.at_end=false",
            "checkpoint.resume=never",
            "logging.progress_bar=false",
            f"run_dir={run_dir}",
            f"name=every-{every}",
        ],
    )
    records = UnifiedTrainer(cfg).run()
    steps_s = sum(r.get("time/step_s", 0.0) for r in records)
    wall_s = records[-1]["time/elapsed_s"]
    out: dict[str, Any] = {
        "eval_every": every,
        "wall_s": round(wall_s, 2),
        "s_per_step": round(wall_s / steps, 4),
        "loop_wait_s": round(wall_s - steps_s, 3),
        "trainer_idle_s": round(sum(r.get("async/trainer_idle_s", 0.0) for r in records), 3),
    }
    evals = [r for r in records if "eval/n" in r]
    if evals:
        out["evaluations"] = len(evals)
        out["eval_versions_landed_at"] = [[int(r["eval/policy_version"]), r["step"]] for r in evals]
        out["eval_time_s_mean"] = round(sum(r["eval/time_s"] for r in evals) / len(evals), 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=MAIN_JOB)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--mode", choices=["async", "sync"], default="async")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = [
            measure(args.config, args.steps, every, tmp, args.mode) for every in (0, args.every)
        ]
    print(json.dumps({"mode": args.mode, "steps": args.steps, "without": runs[0], "with": runs[1]}))


if __name__ == "__main__":
    main()
