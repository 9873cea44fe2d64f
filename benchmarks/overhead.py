"""Control-plane overhead of the real trainer with zero-latency sim workflows and backend.

Prints one JSON line:
- episodes_per_s: rollouts through the whole trainer (dispatch, workflow, buffer, advantages,
  coordinator, training calls) per wall second on one core, generation and training taking no time,
  with admission allowing `--in-flight` rollouts at once (one step of look-ahead);
- episodes_per_cpu_s: the same per CPU second of this process, less skewed by other processes;
- loop_lag_p50_ms / loop_lag_p99_ms: how late a 1 ms timer fires on the real clock while
  `--in-flight` rollouts decode in the simulator (default 4,096);
- sync_overhead_p50_ms / sync_overhead_max_ms: the weight sync's control cost (pause, hook call,
  resume), excluding the hook's own time;
- load_1min: the machine's load average before each part (other processes skew every figure).

Both parts run under the collector settings of `rllm-async train` (`collector_for_rollouts`), or
Python's defaults with `--collector default`.

Usage: python benchmarks/overhead.py [--steps N] [--in-flight 16384] [--collector default]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import tempfile
import time

from rllm_async.backends.sim import workload_config
from rllm_async.cli import collector_for_rollouts
from rllm_async.config import Config
from rllm_async.trainer import UnifiedTrainer
from rllm_async.vclock import run


def _config(tmp: str, overrides: list[str]) -> Config:
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


GROUP_SIZE = 8


def throughput_config(tmp: str, steps: int, in_flight: int) -> Config:
    """Zero-latency generation, training and sync, with admission allowing `in_flight` rollouts
    (two steps' worth of groups)."""
    groups = in_flight // (2 * GROUP_SIZE)
    return _config(
        tmp,
        [
            "backend.latency=zero",
            f"backend.slots={in_flight}",  # the step profile in closed form: a quick start
            "workflow.args.len_median=4",
            "workflow.args.len_sigma=0",
            f"train.total_steps={steps}",
            f"train.groups_per_step={groups}",
            f"train.micro_batch_groups={max(1, groups // 4)}",
            f"rollout.group_size={GROUP_SIZE}",
            f"rollout.max_concurrency={in_flight}",
            "coordinator.pipeline_depth=1",
            "coordinator.max_staleness=1",
        ],
    )


def collector(tuned: bool) -> contextlib.AbstractContextManager[None]:
    """The collector settings of `rllm-async train` when `tuned`, else Python's defaults."""
    return collector_for_rollouts() if tuned else contextlib.nullcontext()


def throughput(steps: int, in_flight: int, tuned: bool) -> tuple[float, float, list[float]]:
    """Episodes per wall second and per CPU second of this process through `throughput_config`."""
    with tempfile.TemporaryDirectory() as tmp:
        trainer = UnifiedTrainer(throughput_config(tmp, steps, in_flight))
        t0, cpu0 = time.perf_counter(), time.process_time()
        # The real clock: every microsecond of control-plane work is counted.
        with collector(tuned):  # set once the trainer is built, as the command sets it
            records = run(trainer.fit(), virtual=False)
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    episodes = steps * (in_flight // 2)
    overheads = [r["time/sync_overhead_s"] * 1e3 for r in records]
    return episodes / elapsed, episodes / cpu, overheads


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


def loop_lag(seconds: float, in_flight: int, tuned: bool) -> tuple[list[float], int]:
    """Timer lateness on the real clock with `in_flight` rollouts decoding in the PS simulator at
    400,000 tokens/s in all, so that about 4,000 end each second whatever `in_flight` is."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = _config(
            tmp,
            [
                f"backend.slots={in_flight}",
                "backend.rmax=400000",
                "backend.t_sync=0.01",
                "backend.train_ratio=null",
                "backend.train_rate=10000000",
                "workflow.args.len_median=100",
                "train.total_steps=1000",
                f"train.groups_per_step={in_flight // GROUP_SIZE}",
                f"train.micro_batch_groups={in_flight // GROUP_SIZE // 8}",
                f"rollout.group_size={GROUP_SIZE}",
                f"rollout.max_concurrency={in_flight}",
                "coordinator.pipeline_depth=0",
                "coordinator.max_staleness=0",
            ],
        )
        trainer = UnifiedTrainer(cfg)
        with collector(tuned):
            return run(_lag_under_load(trainer, seconds), virtual=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lag-seconds", type=float, default=10.0)
    parser.add_argument("--in-flight", type=int, default=4096, help="rollouts in flight at once")
    parser.add_argument("--collector", choices=["rollouts", "default"], default="rollouts")
    args = parser.parse_args()
    if args.in_flight < 8 * GROUP_SIZE or args.in_flight % (8 * GROUP_SIZE):
        parser.error(f"--in-flight must be a positive multiple of {8 * GROUP_SIZE}")
    tuned = args.collector == "rollouts"
    load_throughput = os.getloadavg()[0]
    eps, eps_cpu, overheads = throughput(args.steps, args.in_flight, tuned)
    load_lag = os.getloadavg()[0]
    lags, peak = loop_lag(args.lag_seconds, args.in_flight, tuned)
    lags.sort()
    print(
        json.dumps(
            {
                "in_flight": args.in_flight,
                "collector": args.collector,
                "load_1min": [round(load_throughput, 2), round(load_lag, 2)],
                "episodes_per_s": round(eps),
                "episodes_per_cpu_s": round(eps_cpu),
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
