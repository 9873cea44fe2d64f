"""Control-plane overhead of the real trainer with zero-latency sim workflows and backend.

Prints one JSON line:
- episodes_per_s: rollouts through the whole trainer (dispatch, workflow, buffer, advantages,
  coordinator, training calls) per wall second on one core, generation and training taking no time;
- loop_lag_p50_ms / loop_lag_p99_ms: how late a 1 ms timer fires on the real clock while 4,096
  rollouts are in flight;
- sync_overhead_p50_ms / sync_overhead_max_ms: the weight sync's control cost (pause, hook call,
  resume), excluding the hook's own time.

Usage: python benchmarks/overhead.py [--steps N]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import tempfile
import time

from rllm_async.backends.sim import workload_config
from rllm_async.trainer import UnifiedTrainer
from rllm_async.vclock import run


def _config(tmp: str, overrides: list[str]):
    return workload_config(
        "W1",
        [
            f"run_dir={tmp}",
            "logging.progress_bar=false",
            "logging.jsonl=false",
            "checkpoint.at_end=false",
            "checkpoint.resume=never",
            "algorithm.filter_zero_variance=false",
            *overrides,
        ],
    )


def throughput(steps: int) -> tuple[float, list[float]]:
    """Episodes per wall second with zero-latency generation, training and sync."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = _config(
            tmp,
            [
                "backend.latency=zero",
                "workflow.args.len_median=4",
                "workflow.args.len_sigma=0",
                f"train.total_steps={steps}",
                "train.groups_per_step=64",
                "train.micro_batch_groups=16",
                "rollout.group_size=8",
                "rollout.max_concurrency=4096",
                "coordinator.pipeline_depth=2",
                "coordinator.max_staleness=2",
            ],
        )
        trainer = UnifiedTrainer(cfg)
        t0 = time.perf_counter()
        # The real clock: every microsecond of control-plane work is counted.
        records = run(trainer.fit(), virtual=False)
        elapsed = time.perf_counter() - t0
    episodes = steps * 64 * 8
    overheads = [r["time/sync_overhead_s"] * 1e3 for r in records]
    return episodes / elapsed, overheads


async def _lag_under_load(trainer: UnifiedTrainer, seconds: float) -> tuple[list[float], int]:
    lags: list[float] = []
    peak = 0
    fit = asyncio.create_task(trainer.fit())
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while loop.time() < end and not fit.done():
        t0 = loop.time()
        await asyncio.sleep(0.001)
        lags.append((loop.time() - t0 - 0.001) * 1e3)
        peak = max(peak, trainer.coordinator.counts.in_flight * trainer.config.rollout.group_size)
    fit.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await fit
    return lags, peak


def loop_lag(seconds: float) -> tuple[list[float], int]:
    """Timer lateness on the real clock with 4,096 rollouts decoding in the PS simulator."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = _config(
            tmp,
            [
                "backend.slots=4096",
                "backend.rmax=400000",
                "backend.t_sync=0.01",
                "backend.train_ratio=null",
                "backend.train_rate=10000000",
                "workflow.args.len_median=100",
                "train.total_steps=1000",
                "train.groups_per_step=512",
                "train.micro_batch_groups=64",
                "rollout.group_size=8",
                "rollout.max_concurrency=4096",
                "coordinator.pipeline_depth=0",
                "coordinator.max_staleness=0",
            ],
        )
        trainer = UnifiedTrainer(cfg)
        return run(_lag_under_load(trainer, seconds), virtual=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lag-seconds", type=float, default=10.0)
    args = parser.parse_args()
    eps, overheads = throughput(args.steps)
    lags, peak = loop_lag(args.lag_seconds)
    lags.sort()
    print(
        json.dumps(
            {
                "episodes_per_s": round(eps),
                "loop_lag_p50_ms": round(statistics.median(lags), 3),
                "loop_lag_p99_ms": round(lags[int(0.99 * (len(lags) - 1))], 3),
                "loop_lag_samples": len(lags),
                "rollouts_in_flight_peak": peak,
                "sync_overhead_p50_ms": round(statistics.median(overheads), 4),
                "sync_overhead_max_ms": round(max(overheads), 4),
            }
        )
    )


if __name__ == "__main__":
    main()
