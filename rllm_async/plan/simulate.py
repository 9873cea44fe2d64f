"""Run a sim workload through the real trainer, sync and async side by side, and report figures."""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Callable
from typing import Any

from rllm_async.backends.sim import SimBackend, ps_rate, workload_config
from rllm_async.config import Config
from rllm_async.trainer import UnifiedTrainer
from rllm_async.vclock import run
from rllm_async.workflows.base import Workflow

QUIET = [
    "logging.progress_bar=false",
    "logging.jsonl=false",
    "checkpoint.at_end=false",
    "checkpoint.resume=never",
    "eval.at_end=false",
    # The calibration of T_gen(sync) assumes every group trains, so no filtering.
    "algorithm.filter_zero_variance=false",
]
KL_WINDOW = 10  # steps over which `sampler_kl_peak` averages: a budget kept step by step, not once


def run_workload(workload: str, overrides: list[str]) -> dict[str, Any]:
    """One training run of `workload` on the virtual clock; its simulated time and its figures."""
    return run_config(lambda quiet: workload_config(workload, quiet + overrides))


def run_config(
    make_config: Callable[[list[str]], Config], workflow: Workflow | None = None
) -> dict[str, Any]:
    """One sim training run of `make_config(quiet overrides)` on the virtual clock (with
    `workflow` instead of the config's when given); its figures."""
    with tempfile.TemporaryDirectory() as tmp:
        config = make_config([f"run_dir={tmp}", *QUIET])
        trainer = UnifiedTrainer(config, workflow=workflow)
        backend = trainer.backend
        assert isinstance(backend, SimBackend)

        async def timed() -> float:
            loop = asyncio.get_running_loop()
            start = loop.time()
            await trainer.fit()
            return loop.time() - start

        wall0 = time.perf_counter()
        sim_s = run(timed(), virtual=True)
        wall_s = time.perf_counter() - wall0
    records = trainer.records
    k = config.coordinator.max_staleness
    staleness = [step - group[5] for step, groups in enumerate(backend.trained) for group in groups]
    trained_tokens = sum(sum(group[4]) for groups in backend.trained for group in groups)
    opts = backend.opts
    full_rate = ps_rate(min(opts.slots, trainer.max_concurrency), opts.rmax, opts.n_half)
    learner_s = trained_tokens / backend.train_rate
    if opts.train_drift_steps and opts.train_growth != 1.0:  # seconds per token drift by step
        learner_s = sum(
            sum(sum(group[4]) for group in groups) * backend.seconds_per_token(step)
            for step, groups in enumerate(backend.trained)
        )
    train_s = learner_s + len(records) * (opts.t_sync + opts.t_optim)
    idle = sum(r["async/trainer_idle_ratio"] * r["time/step_s"] for r in records)
    return {
        "time_s": sim_s,
        "wall_s": wall_s,
        "steps": len(records),
        "first_step_s": records[0]["time/step_s"] if records else 0.0,
        "t_ideal_s": max(trained_tokens / full_rate, train_s),
        "waste": _waste(records),
        "waste_steady": _waste(records[:-1] or records),
        "staleness_max": max(staleness, default=0),
        "staleness_mean": sum(staleness) / len(staleness) if staleness else 0.0,
        "staleness_p50": _quantile(staleness, 0.5),
        "staleness_p90": _quantile(staleness, 0.9),
        "violations": sum(s > k for s in staleness) if k is not None else 0,
        "trainer_idle_ratio": idle / sum(r["time/step_s"] for r in records),
        "dropped_stale": sum(r["groups/dropped_stale"] for r in records),
        "sampler_kl": _sampler_kl(records),
        "sampler_kl_peak": max(
            _sampler_kl(records[i : i + KL_WINDOW])
            for i in range(max(1, len(records) - KL_WINDOW + 1))
        ),
    }


def _waste(records: list[dict[str, float]]) -> float:
    """Wasted / generated tokens over `records`; without the last one, a run's steady state (the
    last holds the groups the run's end cancelled)."""
    generated = sum(r.get("tokens/generated", 0.0) for r in records)
    return sum(r.get("tokens/wasted", 0.0) for r in records) / generated if generated else 0.0


def _sampler_kl(records: list[dict[str, float]]) -> float:
    """The trained tokens' mean `loss/sampler_kl` over `records` (0 where none records it)."""
    tokens = sum(r.get("loss/num_tokens", 0.0) for r in records if "loss/sampler_kl" in r)
    kl = sum(r["loss/sampler_kl"] * r["loss/num_tokens"] for r in records if "loss/sampler_kl" in r)
    return kl / tokens if tokens else 0.0


def _quantile(values: list[int], q: float) -> int:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] if values else 0


def sync_baselines(workload: str, common: list[str]) -> tuple[float, float]:
    """Simulated seconds of classic sync (generate the step, then train it) and of streaming sync."""
    classic = run_workload(
        workload, ["mode=sync", "train.micro_batch_groups=${train.groups_per_step}", *common]
    )
    streaming = run_workload(workload, ["mode=sync", *common])
    return classic["time_s"], streaming["time_s"]


def compare(classic_s: float, streaming_s: float, tested: dict[str, Any]) -> dict[str, Any]:
    """The figures of one tested run against the two sync baselines."""
    return {
        "t_sync_s": round(classic_s, 3),
        "t_sync_streaming_s": round(streaming_s, 3),
        "t_async_s": round(tested["time_s"], 3),
        "t_ideal_s": round(tested["t_ideal_s"], 3),
        "speedup": round(classic_s / tested["time_s"], 4),
        "speedup_vs_streaming_sync": round(streaming_s / tested["time_s"], 4),
        "efficiency": round(tested["t_ideal_s"] / tested["time_s"], 4),
        "waste": round(tested["waste"], 4),
        "waste_steady": round(tested["waste_steady"], 4),
        "staleness_max": tested["staleness_max"],
        "staleness_mean": round(tested["staleness_mean"], 3),
        "violations": tested["violations"],
        "dropped_stale": tested["dropped_stale"],
        "trainer_idle_ratio": round(tested["trainer_idle_ratio"], 4),
        "wall_s": round(tested["wall_s"], 3),
    }


def simulate(
    workload: str,
    *,
    mode: str = "async",
    pipeline_depth: int | str = 4,
    max_staleness: int | None = None,
    steps: int = 60,
    seed: int = 0,
    overrides: list[str] | None = None,
) -> dict[str, Any]:
    """Sync baselines vs the requested setting on `workload`; one flat dict of figures.

    `t_sync_s` is classic synchronous RL: generate the whole step, then train it
    (`micro_batch_groups = groups_per_step`), the baseline the workloads are calibrated on.
    `t_sync_streaming_s` is our `mode: sync` with streamed micro-batches, which already overlaps
    training with the tail of generation. `t_ideal_s = max(T_gen at full concurrency, train +
    sync time)` for the tokens the run trained; efficiency is `t_ideal_s / t_async_s`; waste is
    discarded tokens / generated tokens, `waste_steady` the same without the last step's record
    (which holds the groups that the run's end cancelled).
    """
    common = [f"train.total_steps={steps}", f"seed={seed}", *(overrides or [])]
    classic_s, streaming_s = sync_baselines(workload, common)
    if mode == "sync":
        tested = run_workload(workload, ["mode=sync", *common])
    else:
        k = "null" if max_staleness is None else str(max_staleness)
        tested = run_workload(
            workload,
            [
                "mode=async",
                f"coordinator.pipeline_depth={pipeline_depth}",
                f"coordinator.max_staleness={k}",
                *common,
            ],
        )
    return {
        "workload": workload,
        "mode": mode,
        "pipeline_depth": 0 if mode == "sync" else pipeline_depth,
        "max_staleness": 0 if mode == "sync" else max_staleness,
        "steps": steps,
        **compare(classic_s, streaming_s, tested),
    }
