"""`auto` (`coordinator.pipeline_depth: auto` and `rollout.max_concurrency: auto`) against the
best fixed setting, on the sim's virtual clock.

For each workload (W1-W4 stationary, D1-D4 drifting), each hard bound (none, and each K) and each
seed: the simulated time and steady waste (wasted / generated tokens, the run's last step left
out: it holds what the run's end cancelled) of every fixed setting and of `auto`, and where the
workload has a sampler-KL budget (D4: `coordinator.auto.max_sampler_kl`), each run's peak KL (the
highest mean over 10 steps in a row). A fixed setting is a depth the bound allows (`d`), at the
workload's own `max_concurrency`, or at each of `--concurrencies` (`d@c`); the best is the fastest
within the KL budget. Prints one JSON line: per workload and bound, per seed the times, wastes,
peak KLs, the best fixed setting and `auto_vs_best` = best fixed time / auto time (above 1: auto
is faster); and their mean and minimum.

Usage: python benchmarks/auto_depth.py [--steps 60] [--seeds 0 1 2] [--bounds none 8 4] [--jobs 2]
[--concurrencies 512 1024 2048] [--reuse OLD.json]: the fixed settings' figures from an earlier
output of the same cells (only `auto` runs again; a fixed setting's run has no controller).

`--phases`: also, for each drifting workload, its start and its end as stationary workloads (seed
0): each fixed setting's time on both, and `switch_bound` = the best fixed setting's time over the
two / the sum of each one's best time (within the KL budget): the most that choosing the setting
per phase could gain.
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ProcessPoolExecutor
from itertools import product

from rllm_async.backends.sim import workload_config
from rllm_async.plan.simulate import run_workload

Cell = tuple[str, str, int, str, int]  # workload, bound, seed, setting, steps

# A drifting workload frozen at its start (no drift) and at its end (the drifted values from the
# first version on).
PHASES = {
    "start": (
        "workflow.args.drift_steps=0",
        "backend.train_drift_steps=0",
        "backend.kl_drift_steps=0",
    ),
    "end": (
        "workflow.args.drift_shape=step",
        "workflow.args.drift_steps=1",
        "backend.train_drift_shape=step",
        "backend.train_drift_steps=1",
        "backend.kl_drift_steps=1",
    ),
}
Figures = tuple[float, float, float]  # simulated seconds, steady waste, peak sampler KL


def _one(cell: Cell, more: tuple[str, ...] = ()) -> Figures:
    workload, bound, seed, setting, steps = cell
    depth, _, concurrency = setting.partition("@")
    overrides = [
        *more,
        "mode=async",
        f"coordinator.pipeline_depth={depth}",
        f"coordinator.max_staleness={'null' if bound == 'none' else bound}",
        f"train.total_steps={steps}",
        f"seed={seed}",
    ]
    if setting == "auto":
        overrides.append("rollout.max_concurrency=auto")
    elif concurrency:
        overrides.append(f"rollout.max_concurrency={concurrency}")
    figures = run_workload(workload, overrides)
    return (
        float(figures["time_s"]),
        float(figures["waste_steady"]),
        float(figures["sampler_kl_peak"]),
    )


def _settings(args: argparse.Namespace, bound: str) -> list[str]:
    """The fixed settings a hard bound allows (d <= K): each depth, at each concurrency."""
    depths = [d for d in args.depths if bound == "none" or int(d) <= int(bound)]
    if not args.concurrencies:
        return depths
    return [f"{d}@{c}" for d in depths for c in args.concurrencies]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--depths", nargs="+", default=["1", "2", "4", "8"])
    parser.add_argument("--bounds", nargs="+", default=["none", "8", "4"])
    parser.add_argument(
        "--concurrencies", nargs="+", default=[], help="max_concurrency values (default: own)"
    )
    parser.add_argument(
        "--workloads", nargs="+", default=["W1", "W2", "W3", "W4", "D1", "D2", "D3", "D4"]
    )
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--reuse", default=None, help="an earlier output: its fixed figures")
    parser.add_argument("--phases", action="store_true", help="drifting workloads' start and end")
    args = parser.parse_args()
    results: dict[Cell, Figures] = {}
    if args.reuse:
        with open(args.reuse) as f:
            old = json.load(f)
        if old["steps"] != args.steps:
            parser.error(f"--reuse {args.reuse} ran {old['steps']} steps, not {args.steps}")
        for w, b in product(args.workloads, args.bounds):
            for p in old.get(f"{w}_K{b}", {}).get("seeds", []):
                for d in _settings(args, b):
                    if d in p["time_s"]:
                        kl = p.get("kl_peak", {}).get(d, 0.0)
                        results[(w, b, p["seed"], d, args.steps)] = (
                            p["time_s"][d],
                            p["waste"][d],
                            kl,
                        )
    cells = [
        (w, b, s, d, args.steps)
        for w, b, s in product(args.workloads, args.bounds, args.seeds)
        for d in [*_settings(args, b), "auto"]
        if (w, b, s, d, args.steps) not in results
    ]
    with ProcessPoolExecutor(args.jobs) as pool:
        results.update(zip(cells, pool.map(_one, cells), strict=True))
        phases = _phases(args, pool) if args.phases else None
    out: dict[str, object] = {"steps": args.steps, "seeds": args.seeds}
    for w, b in product(args.workloads, args.bounds):
        settings = [*_settings(args, b), "auto"]
        budget = workload_config(w).coordinator.auto.max_sampler_kl
        per_seed = []
        for s in args.seeds:
            figures = {d: results[(w, b, s, d, args.steps)] for d in settings}
            fixed = {
                d: t
                for d, (t, _, kl) in figures.items()
                if d != "auto" and (budget is None or kl <= budget)
            }
            if not fixed:
                raise SystemExit(f"{w} K={b} seed {s}: no fixed setting keeps the KL budget")
            best = min(fixed, key=fixed.__getitem__)
            per_seed.append(
                {
                    "seed": s,
                    "time_s": {d: round(t, 1) for d, (t, _, _) in figures.items()},
                    "waste": {d: round(x, 4) for d, (_, x, _) in figures.items()},
                    **(
                        {"kl_peak": {d: round(kl, 5) for d, (_, _, kl) in figures.items()}}
                        if budget is not None
                        else {}
                    ),
                    "best_fixed": best,
                    "auto_vs_best": round(fixed[best] / figures["auto"][0], 4),
                }
            )
        ratios = [p["auto_vs_best"] for p in per_seed]
        out[f"{w}_K{b}"] = {
            **({"kl_budget": budget} if budget is not None else {}),
            "seeds": per_seed,
            "auto_vs_best_mean": round(sum(ratios) / len(ratios), 4),
            "auto_vs_best_min": min(ratios),
        }
    if phases is not None:
        out["phases"] = phases
    print(json.dumps(out))


def _phases(args: argparse.Namespace, pool: ProcessPoolExecutor) -> dict[str, object]:
    """Each drifting workload's start and end, stationary, at each fixed setting (seed 0)."""
    drifting = [w for w in args.workloads if w.startswith("D")]
    runs = [
        ((w, b, 0, d, args.steps), PHASES[phase])
        for w, b, phase in product(drifting, args.bounds, PHASES)
        for d in _settings(args, b)
    ]
    figures = iter(pool.map(_one, *zip(*runs, strict=True)))
    out: dict[str, object] = {}
    for w, b in product(drifting, args.bounds):
        settings = _settings(args, b)
        budget = workload_config(w).coordinator.auto.max_sampler_kl
        f = {phase: {d: next(figures) for d in settings} for phase in PHASES}
        t = {phase: {d: x[0] for d, x in f[phase].items()} for phase in PHASES}
        kept = {  # the settings within the KL budget in each phase
            phase: {d for d, x in f[phase].items() if budget is None or x[2] <= budget}
            for phase in PHASES
        }
        both = min(t["start"][d] + t["end"][d] for d in kept["start"] & kept["end"])
        each = sum(min(t[phase][d] for d in kept[phase]) for phase in PHASES)
        out[f"{w}_K{b}"] = {
            **{phase: {d: round(x, 1) for d, x in t[phase].items()} for phase in PHASES},
            "switch_bound": round(both / each, 4),
        }
    return out


if __name__ == "__main__":
    main()
