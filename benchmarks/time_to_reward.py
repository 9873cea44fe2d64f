"""The main job (countdown, local backend) in sync and async mode, side by side, per seed.

For each mode and seed it trains for `--steps` steps with held-out greedy evaluation every
`--eval-every` steps, and reports: wall seconds per step, the training reward over wall time, the
held-out accuracy curve, and the wall time at which the rolling training reward first reaches
`--target` (None if never). Prints one JSON line.

Usage: python benchmarks/time_to_reward.py [--steps 100] [--seeds 0 1 2] [--target 0.35]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from rllm_async.config import load_config
from rllm_async.trainer import UnifiedTrainer

CONFIGS = {
    "sync": "examples/countdown/local_sync.yaml",
    "async": "examples/countdown/local_async.yaml",
}


def one_run(mode: str, seed: int, steps: int, eval_every: int, tmp: str) -> dict[str, object]:
    config = load_config(
        CONFIGS[mode],
        [
            f"name={mode}-{seed}",
            f"run_dir={tmp}",
            f"seed={seed}",
            f"train.total_steps={steps}",
            f"eval.every_steps={eval_every}",
            "checkpoint.every_steps=0",
            "checkpoint.at_end=false",
            "checkpoint.resume=never",
            "logging.progress_bar=false",
        ],
    )
    trainer = UnifiedTrainer(config)  # the warm start is cached: built once, then loaded
    t0 = time.perf_counter()
    records = trainer.run()
    wall = time.perf_counter() - t0
    return {
        "wall_s": round(wall, 1),
        "s_per_step": round(wall / len(records), 3),
        "reward": [(round(r["time/elapsed_s"], 1), round(r["reward/mean"], 3)) for r in records],
        "eval_accuracy": [
            (int(r["step"]), round(r["time/elapsed_s"], 1), r["eval/accuracy"])
            for r in records
            if "eval/accuracy" in r
        ],
        "staleness_mean": round(sum(r["staleness/mean"] for r in records) / len(records), 3),
    }


def time_to(curve: list[tuple[float, float]], target: float, window: int = 10) -> float | None:
    """Wall seconds at which the mean of the last `window` step rewards first reaches `target`."""
    for i in range(window, len(curve) + 1):
        if sum(r for _, r in curve[i - window : i]) / window >= target:
            return curve[i - 1][0]
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--target", type=float, default=0.35)
    args = parser.parse_args()
    out: dict[str, object] = {"steps": args.steps, "target_train_reward": args.target}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for mode in ("sync", "async"):  # alternate so that load drifts hit both alike
                result = one_run(mode, seed, args.steps, args.eval_every, tmp)
                curve = result.pop("reward")
                assert isinstance(curve, list)
                result["time_to_target_s"] = time_to(curve, args.target)
                result["final_train_reward_10"] = round(sum(r for _, r in curve[-10:]) / 10, 3)
                out[f"{mode}_seed{seed}"] = result
    print(json.dumps(out))


if __name__ == "__main__":
    main()
