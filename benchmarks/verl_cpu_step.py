"""Per-step time of the verl backend on the CPU and the cost of one weight export; one JSON line.

    .venv-verl/bin/python benchmarks/verl_cpu_step.py [--steps 8] [--hidden 64] [--layers 4]

Two FSDP2 workers (gloo) train a tiny random Llama on countdown prompts in async mode.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rllm_async import UnifiedTrainer

# The tiny checkpoint builder and the test config live with the verl tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration" / "verl"))
from test_verl_cpu import make_config
from tiny_checkpoint import write_tiny_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--exports", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_tiny_checkpoint(Path(tmp) / "ckpt", hidden=args.hidden, layers=args.layers)
        cfg = make_config(
            ckpt,
            Path(tmp) / "runs",
            mode="async",
            train={"total_steps": args.steps, "groups_per_step": 8, "micro_batch_groups": 4},
            rollout={"group_size": 4, "max_tokens": 16, "timeout_s": 300},
            algorithm={"filter_zero_variance": False},  # time every step, learning or not
        )
        start = time.perf_counter()
        trainer = UnifiedTrainer(cfg)
        startup_s = time.perf_counter() - start
        backend = trainer.backend
        exports = []
        for version in range(args.exports):
            asyncio.run(backend.on_policy_updated(version))
            exports.append(backend.export_s)
        records = trainer.run()
    steps = [r["time/step_s"] for r in records[1:]]  # the first step includes warm-up
    params = sum(p.numel() for p in backend.store.get(None)[1].parameters())
    print(
        json.dumps(
            {
                "benchmark": "verl_cpu_step",
                "workers": 2,
                "params": params,
                "steps": len(records),
                "startup_s": round(startup_s, 1),
                "step_s_median": round(statistics.median(steps), 3),
                "optim_step_s_median": round(
                    statistics.median(r["time/optim_step_s"] for r in records[1:]), 3
                ),
                "forward_backward_s_median": round(
                    statistics.median(r["time/forward_backward_s"] for r in records[1:]), 3
                ),
                "sync_s_median": round(statistics.median(r["time/sync_s"] for r in records[1:]), 3),
                "export_s_median": round(statistics.median(exports), 3),
                "tokens_per_step": round(
                    statistics.mean(r["optim/num_tokens"] for r in records), 1
                ),
            }
        )
    )


if __name__ == "__main__":
    main()
