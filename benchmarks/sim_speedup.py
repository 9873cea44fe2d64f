"""Async vs sync on the simulated workloads W1-W3 through the real trainer, on a virtual clock.

Prints one JSON line: for each workload its two sync baselines (classic generate-then-train, and
our streaming `mode: sync`), then for each pipeline depth d the async time, speedup, efficiency
(t_ideal / t_async), waste, staleness and violations; then the hard-bound runs (K=8, d=4 on W1);
then the wall time of 60 simulated W1 steps.

Usage: python benchmarks/sim_speedup.py [--steps 60] [--depths 1 2 4 8]
"""

from __future__ import annotations

import argparse
import json

from rllm_async.simulate import run_workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--depths", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    common = [f"train.total_steps={args.steps}", f"seed={args.seed}"]
    out: dict[str, object] = {"steps": args.steps, "seed": args.seed}

    def row(base: dict, tested: dict) -> dict:
        return {
            "t_async_s": round(tested["time_s"], 1),
            "t_ideal_s": round(tested["t_ideal_s"], 1),
            "speedup": round(base["classic"] / tested["time_s"], 3),
            "speedup_vs_streaming_sync": round(base["streaming"] / tested["time_s"], 3),
            "efficiency": round(tested["t_ideal_s"] / tested["time_s"], 3),
            "waste": round(tested["waste"], 4),
            "staleness_max": tested["staleness_max"],
            "staleness_mean": round(tested["staleness_mean"], 2),
            "violations": tested["violations"],
            "trainer_idle_ratio": round(tested["trainer_idle_ratio"], 3),
            "wall_s": round(tested["wall_s"], 2),
        }

    bases = {}
    for workload in ("W1", "W2", "W3"):
        classic = run_workload(
            workload, ["mode=sync", "train.micro_batch_groups=${train.groups_per_step}", *common]
        )
        streaming = run_workload(workload, ["mode=sync", *common])
        base = bases[workload] = {"classic": classic["time_s"], "streaming": streaming["time_s"]}
        result: dict[str, object] = {
            "t_sync_s": round(classic["time_s"], 1),
            "t_sync_streaming_s": round(streaming["time_s"], 1),
        }
        for d in args.depths:
            tested = run_workload(
                workload,
                [
                    "mode=async",
                    f"coordinator.pipeline_depth={d}",
                    "coordinator.max_staleness=null",
                    *common,
                ],
            )
            result[f"d{d}"] = row(base, tested)
        out[workload] = result

    hard = {}
    for concurrency in (512, 256):
        tested = run_workload(
            "W1",
            [
                "mode=async",
                "coordinator.pipeline_depth=4",
                "coordinator.max_staleness=8",
                f"rollout.max_concurrency={concurrency}",
                *common,
            ],
        )
        hard[f"concurrency_{concurrency}"] = row(bases["W1"], tested)
    out["W1_hard_bound_K8_d4"] = hard
    print(json.dumps(out))


if __name__ == "__main__":
    main()
