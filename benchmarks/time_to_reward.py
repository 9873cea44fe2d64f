"""A config (the main job by default) in sync and async mode, side by side, per seed.

Sync is the config with `mode=sync coordinator.pipeline_depth=0 coordinator.max_staleness=0`.
For each seed it runs sync then async (alternating, so that load drifts hit both alike) for
`--steps` steps, scoring the policy on the held-out set (greedy) before the first step and every
`--eval-every` steps, and reports per run: wall seconds per step, the held-out accuracy curve
over wall time, and the wall time at which held-out accuracy first reaches each `--targets` value
(None if never); then the sync/async ratio of those times. An accuracy is placed at the wall time
its policy version was published; evaluations run beside training in both modes, so their cost
shows as slower steps, and `eval_lag_s` is how long after that time they landed on average.
Prints one JSON line.

`--modes async auto` compares the config as it is with `coordinator.pipeline_depth: auto`
(`auto_all`: that and `rollout.max_concurrency: auto`);
`speedup_seed<N>` is always the first mode's time over the second's.

Usage: python benchmarks/time_to_reward.py [--config examples/countdown/local_async.yaml]
           [--modes sync async] [--steps 300] [--seeds 0 1 2] [--targets 0.4 0.5 0.6]
           [--set backend.device=cuda ...]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from rllm_async.config import load_config
from rllm_async.trainer import UnifiedTrainer

MODES = {
    "sync": ["mode=sync", "coordinator.pipeline_depth=0", "coordinator.max_staleness=0"],
    "async": ["mode=async"],
    "auto": ["mode=async", "coordinator.pipeline_depth=auto"],  # the depth controller
    # and the concurrency controller
    "auto_all": ["mode=async", "coordinator.pipeline_depth=auto", "rollout.max_concurrency=auto"],
}


def one_run(
    path: str, mode: str, seed: int, steps: int, eval_every: int, tmp: str, extra: list[str]
) -> dict[str, object]:
    config = load_config(
        path,
        [
            *extra,
            *MODES[mode],
            f"name={mode}-{seed}",
            f"run_dir={tmp}",
            f"seed={seed}",
            f"train.total_steps={steps}",
            f"eval.every_steps={eval_every}",
            "eval.at_start=true",
            "checkpoint.every_steps=0",
            "checkpoint.at_end=false",
            "checkpoint.resume=never",
            "logging.progress_bar=false",
        ],
    )
    trainer = UnifiedTrainer(config)  # warm starts and GGUF conversions are cached: made once
    t0 = time.perf_counter()
    records = trainer.run()
    wall = time.perf_counter() - t0
    steps_run = [r for r in records if "time/step_s" in r]
    published = {0: 0.0} | {int(r["step"]): r["time/elapsed_s"] for r in steps_run}
    evals = [r for r in records if "eval/accuracy" in r]
    lags = [r["time/elapsed_s"] - published[int(r["eval/policy_version"])] for r in evals]
    return {
        "wall_s": round(wall, 1),
        "s_per_step": round(steps_run[-1]["time/elapsed_s"] / len(steps_run), 3),
        "eval_accuracy": [
            (v := int(r["eval/policy_version"]), round(published[v], 1), r["eval/accuracy"])
            for r in evals
        ],
        "eval_lag_s": round(sum(lags) / len(lags), 1),
        "staleness_mean": round(sum(r["staleness/mean"] for r in steps_run) / len(steps_run), 3),
    }


def time_to(curve: list[tuple[int, float, float]], target: float) -> float | None:
    """Wall seconds of the first evaluation whose held-out accuracy reaches `target`."""
    return next((t for _, t, acc in curve if acc >= target), None)


def ratio(first_s: float | None, second_s: float | None) -> float | None:
    """How many times sooner the second run got there; None unless both did (the second after
    its start)."""
    return round(first_s / second_s, 2) if first_s is not None and second_s else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="examples/countdown/local_async.yaml")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--targets", type=float, nargs="+", default=[0.4, 0.5, 0.6])
    parser.add_argument(
        "--set", nargs="+", default=[], metavar="KEY=VALUE", help="config overrides for every run"
    )
    args = parser.parse_args()
    out: dict[str, object] = {
        "config": args.config,
        "steps": args.steps,
        "eval_every": args.eval_every,
        "set": args.set,
    }
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            times: dict[str, dict[float, float | None]] = {}
            for mode in args.modes:
                result = one_run(
                    args.config, mode, seed, args.steps, args.eval_every, tmp, args.set
                )
                curve = result["eval_accuracy"]
                assert isinstance(curve, list)
                times[mode] = {t: time_to(curve, t) for t in args.targets}
                result["time_to_accuracy_s"] = times[mode]
                out[f"{mode}_seed{seed}"] = result
            if len(times) == 2:  # the first mode's time / the second's
                first, second = args.modes
                out[f"speedup_seed{seed}"] = {
                    t: ratio(times[first][t], times[second][t]) for t in args.targets
                }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
