"""How well `rllm-async plan` predicts recorded runs: pairs of records of one job, async and sync.

For each record, its own setting replayed with each seed, against its measured time per step
(after the first step, as the plan measures it); with `--independent`, the same with the record's
lengths drawn one rollout at a time (its rows read as from before groups were kept whole). For
each pair, the speedup of the async setting over the sync one: measured, from both records (as
`--twin` replays them) and from each record alone.

Prints one JSON line per pair. Usage:
    python benchmarks/plan_accuracy.py --pair countdown RUNS/async RUNS/sync [--pair ...]
        [--steps 60] [--seeds 0,1,2] [--independent]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from rllm_async.plan.fit import FittedWorkload, fit_workload
from rllm_async.plan.record import Workload, read_workload
from rllm_async.plan.replay import Candidate, recorded_candidate, replay


def load(run_dir: str, *, independent: bool = False) -> Workload:
    """The record of `run_dir`; with `independent`, without its groups and their outcomes."""
    workload = read_workload(run_dir)
    if independent:
        for row in workload.rollouts:
            row.group, row.filtered = None, None
    return workload


def errors(f: FittedWorkload, c: Candidate, steps: int, seeds: list[int]) -> list[float]:
    """The replay of `c` with each seed, as a relative error on `f`'s measured time per step."""
    return [round(replay(f, c, steps, seed)["step_s"] / f.measured_step_s - 1, 4) for seed in seeds]


def pair(
    label: str, async_dir: str, sync_dir: str, steps: int, seeds: list[int], independent: bool
) -> dict[str, Any]:
    """The figures of one pair of records."""
    fa, fs = fit_workload(load(async_dir)), fit_workload(load(sync_dir))
    ca, cs = recorded_candidate(fa), recorded_candidate(fs)
    out: dict[str, Any] = {
        "pair": label,
        "measured_s": {"async": round(fa.measured_step_s, 4), "sync": round(fs.measured_step_s, 4)},
        "own_error": {"async": errors(fa, ca, steps, seeds), "sync": errors(fs, cs, steps, seeds)},
    }
    if independent:
        ia, is_ = (
            fit_workload(load(async_dir, independent=True)),
            fit_workload(load(sync_dir, independent=True)),
        )
        out["own_error_independent"] = {
            "async": errors(ia, ca, steps, seeds),
            "sync": errors(is_, cs, steps, seeds),
        }
    a_own = replay(fa, ca, steps)["step_s"]
    s_own = replay(fs, cs, steps)["step_s"]
    measured = fs.measured_step_s / fa.measured_step_s
    predicted = {
        "twin": s_own / a_own,
        "async_record": replay(fa, cs, steps)["step_s"] / a_own,
        "sync_record": s_own / replay(fs, ca, steps)["step_s"],
    }
    out["speedup"] = {"measured": round(measured, 3)} | {
        k: round(v, 3) for k, v in predicted.items()
    }
    out["speedup_error"] = {k: round(v / measured - 1, 3) for k, v in predicted.items()}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--pair",
        nargs=3,
        action="append",
        required=True,
        metavar=("LABEL", "ASYNC_RUN", "SYNC_RUN"),
    )
    p.add_argument("--steps", type=int, default=60, help="steps replayed")
    p.add_argument("--seeds", default="0,1,2", help="replay seeds, comma-separated")
    p.add_argument(
        "--independent",
        action="store_true",
        help="also replay each record with its lengths drawn one rollout at a time",
    )
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    for label, async_dir, sync_dir in args.pair:
        figures = pair(label, async_dir, sync_dir, args.steps, seeds, args.independent)
        print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
