"""Async vs sync on the simulated workloads W1-W3 through the real trainer, on a virtual clock.

Prints one JSON line: for each workload its two sync baselines (classic generate-then-train, and
our streaming `mode: sync`), then for each pipeline depth d the async time, speedup, efficiency
(t_ideal / t_async), waste, staleness and violations; then the hard-bound runs (K=8, d=4 on W1): a fixed limit of 512 and of 256 rollouts
(`rollout.late_concurrency=null`), and 512 with the default late limit.

Usage: python benchmarks/sim_speedup.py [--steps 60] [--depths 1 2 4 8] [--workloads W1 W2 W3]
"""

from __future__ import annotations

import argparse
import json

from rllm_async.plan.simulate import compare, run_workload, sync_baselines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--depths", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workloads", nargs="+", default=["W1", "W2", "W3"])
    args = parser.parse_args()
    common = [f"train.total_steps={args.steps}", f"seed={args.seed}"]
    out: dict[str, object] = {"steps": args.steps, "seed": args.seed}
    bases = {}
    for workload in args.workloads:
        bases[workload] = sync_baselines(workload, common)
        result = {}
        for d in args.depths:
            overrides = [
                "mode=async",
                f"coordinator.pipeline_depth={d}",
                "coordinator.max_staleness=null",
            ]
            result[f"d{d}"] = compare(*bases[workload], run_workload(workload, overrides + common))
        out[workload] = result
    if "W1" in bases:
        hard = {}
        for name, concurrency, late in (
            ("fixed_512", 512, "null"),
            ("fixed_256", 256, "null"),
            ("late_limit_512", 512, "0.5"),
        ):
            overrides = [
                "mode=async",
                "coordinator.pipeline_depth=4",
                "coordinator.max_staleness=8",
                f"rollout.max_concurrency={concurrency}",
                f"rollout.late_concurrency={late}",
            ]
            hard[name] = compare(*bases["W1"], run_workload("W1", overrides + common))
        out["W1_hard_bound_K8_d4"] = hard
    print(json.dumps(out))


if __name__ == "__main__":
    main()
