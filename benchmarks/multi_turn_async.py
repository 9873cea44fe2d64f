"""Async vs sync on a multi-turn task whose environment takes time: wall-clock to the same reward.

Guess-the-number (`examples/guess/local_async.yaml`, the `small` local model after its cached warm
start) with every environment step taking a lognormal time (median `--latency-ms`, shape 1.0), as a
slow tool or simulator would. The same config trains once with `mode: sync` and once with
`mode: async` (pipeline depth 2); both run `--steps` optimizer steps. Prints one JSON line:
- sync_s / async_s: wall-clock of each run; step_s_sync / step_s_async: seconds per step;
- target: a reward both runs reach (unless given: 80% of the way from the first 10 steps' average
  to the lower of the two runs' best 10-step moving averages);
- sync_to_target_s / async_to_target_s: when each run's 10-step moving average of the trained
  reward first reaches it; speedup_to_target: their ratio;
- curve_sync / curve_async: [elapsed_s, reward] per step, for plotting.

`--modes A B` compares any two of `sync`, `async` (d = 2, K = 2), `shipped` (the config's own
d = 1, K = 2), `auto` (`pipeline_depth: auto`) and `auto_all` (that and `rollout.max_concurrency:
auto`), the keys named after them;
speedup_to_target is A's time / B's. `--seed N` sets the run's seed.

Usage: python benchmarks/multi_turn_async.py [--steps 150] [--latency-ms 50] [--target R]
           [--modes sync async] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from typing import Any

from rllm_async.config import load_config
from rllm_async.trainer import UnifiedTrainer

CONFIG = "examples/guess/local_async.yaml"
WINDOW = 10


# The coordinator settings of each mode; `shipped` keeps the config's own (d = 1, K = 2).
MODES = {
    "sync": ["mode=sync", "coordinator.pipeline_depth=0", "coordinator.max_staleness=0"],
    "async": ["mode=async", "coordinator.pipeline_depth=2", "coordinator.max_staleness=2"],
    "shipped": [],
    "auto": ["coordinator.pipeline_depth=auto"],
    "auto_all": ["coordinator.pipeline_depth=auto", "rollout.max_concurrency=auto"],
}


def train(
    mode: str, steps: int, latency_ms: float, seed: int, run_dir: str
) -> list[dict[str, Any]]:
    overrides = [
        f"name=bench-{mode}-{seed}",
        f"run_dir={run_dir}",
        f"seed={seed}",
        f"train.total_steps={steps}",
        "workflow.args.env_args.latency_s=" + str(latency_ms / 1e3),
        "workflow.args.env_args.latency_sigma=1.0",
        "eval.every_steps=0",
        "eval.at_end=false",
        "checkpoint.at_end=false",
        "checkpoint.resume=never",
        "logging.progress_bar=false",
        *MODES[mode],
    ]
    return UnifiedTrainer(load_config(CONFIG, overrides)).run()


def curve(records: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """(elapsed seconds, 10-step moving average of the trained reward) per step."""
    rewards = [r["reward/mean"] for r in records]
    out = []
    for i, r in enumerate(records):
        window = rewards[max(0, i - WINDOW + 1) : i + 1]
        out.append((round(r["time/elapsed_s"], 2), round(sum(window) / len(window), 4)))
    return out


def time_to(points: list[tuple[float, float]], target: float) -> float | None:
    return next((t for t, r in points[WINDOW - 1 :] if r >= target), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--latency-ms", type=float, default=50.0)
    parser.add_argument("--target", type=float, default=None)
    parser.add_argument("--modes", nargs=2, choices=list(MODES), default=["sync", "async"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    first, second = args.modes
    with tempfile.TemporaryDirectory() as tmp:
        curves = {
            m: curve(train(m, args.steps, args.latency_ms, args.seed, tmp)) for m in args.modes
        }
    start = sum(c[WINDOW - 1][1] for c in curves.values()) / 2
    best = min(max(r for _, r in c[WINDOW - 1 :]) for c in curves.values())
    target = args.target if args.target is not None else round(start + 0.8 * (best - start), 4)
    to = {m: time_to(curves[m], target) for m in args.modes}
    out: dict[str, Any] = {"steps": args.steps, "latency_median_ms": args.latency_ms}
    out["seed"] = args.seed
    for m in args.modes:
        out[f"{m}_s"] = curves[m][-1][0]
        out[f"step_s_{m}"] = round(curves[m][-1][0] / args.steps, 3)
    out["target"] = target
    for m in args.modes:
        out[f"{m}_to_target_s"] = to[m]
    t_first, t_second = to[first], to[second]
    out["speedup_to_target"] = round(t_first / t_second, 2) if t_first and t_second else None
    for m in args.modes:
        out[f"curve_{m}"] = curves[m]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
