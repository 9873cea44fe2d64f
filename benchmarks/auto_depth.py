"""`coordinator.pipeline_depth: auto` against the best fixed depth, on the sim's virtual clock.

For each workload (W1-W4 stationary, D1-D2 drifting), each hard bound (none, and K) and each
seed: the simulated time of every fixed depth and of `auto`. Prints one JSON line: per workload
and bound, the times, the best fixed depth per seed, and `auto_vs_best` = best fixed time / auto
time (above 1: auto is faster), per seed and its mean.

Usage: python benchmarks/auto_depth.py [--steps 60] [--seeds 0 1 2] [--bounds none 8] [--jobs 2]
[--reuse OLD.json]: the fixed depths' times from an earlier output of the same cells (only `auto`
runs again; a fixed depth's run does not depend on the controller).
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ProcessPoolExecutor
from itertools import product

from rllm_async.plan.simulate import run_workload


def _one(cell: tuple[str, str, int, str, int]) -> float:
    workload, bound, seed, depth, steps = cell
    overrides = [
        "mode=async",
        f"coordinator.pipeline_depth={depth}",
        f"coordinator.max_staleness={'null' if bound == 'none' else bound}",
        f"train.total_steps={steps}",
        f"seed={seed}",
    ]
    return float(run_workload(workload, overrides)["time_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--depths", nargs="+", default=["1", "2", "4", "8"])
    parser.add_argument("--bounds", nargs="+", default=["none", "8"])
    parser.add_argument("--workloads", nargs="+", default=["W1", "W2", "W3", "W4", "D1", "D2"])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--reuse", default=None, help="an earlier output: its fixed-depth times")
    args = parser.parse_args()
    settings = [*args.depths, "auto"]
    times: dict[tuple[str, str, int, str, int], float] = {}
    if args.reuse:
        with open(args.reuse) as f:
            old = json.load(f)
        assert old["steps"] == args.steps
        for w, b in product(args.workloads, args.bounds):
            for p in old[f"{w}_K{b}"]["seeds"]:
                for d in args.depths:
                    times[(w, b, p["seed"], d, args.steps)] = p["time_s"][d]
    cells = [
        (w, b, s, d, args.steps)
        for w, b, s, d in product(args.workloads, args.bounds, args.seeds, settings)
        if (w, b, s, d, args.steps) not in times
    ]
    with ProcessPoolExecutor(args.jobs) as pool:
        times.update(zip(cells, pool.map(_one, cells), strict=True))
    out: dict[str, object] = {"steps": args.steps, "seeds": args.seeds}
    for w, b in product(args.workloads, args.bounds):
        per_seed = []
        for s in args.seeds:
            fixed = {d: times[(w, b, s, d, args.steps)] for d in args.depths}
            best = min(fixed, key=fixed.__getitem__)
            auto = times[(w, b, s, "auto", args.steps)]
            per_seed.append(
                {
                    "seed": s,
                    "time_s": {d: round(t, 1) for d, t in {**fixed, "auto": auto}.items()},
                    "best_fixed": int(best),
                    "auto_vs_best": round(fixed[best] / auto, 4),
                }
            )
        ratios = [p["auto_vs_best"] for p in per_seed]
        out[f"{w}_K{b}"] = {
            "seeds": per_seed,
            "auto_vs_best_mean": round(sum(ratios) / len(ratios), 4),
            "auto_vs_best_min": min(ratios),
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
