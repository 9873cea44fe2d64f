"""The Tinker backend against the local SkyRL Tinker API server (tiny Qwen3, JAX on CPU):

1. sync vs async: the real trainer, same config, `--steps` optimizer steps each, run alternately
   `--repeats` times; per-step wall time (median over steps 2.., step 1 creates the adapter),
   trainer idle ratio, staleness. Async is d=1 with `weight_update: latest` (SkyRL's samplers are
   not snapshots).
2. forward_backward pipelining: the same fixed batch trained with `pipeline_requests: true`
   (each micro-batch is submitted before the previous one is awaited) and `false` (each awaited
   before the next is sent): seconds per optimizer step of `--micro-batches` forward_backward
   calls plus optim_step, and the time pipelining hides.

Runs in .venv-skyrl (tinker 0.24.1, which speaks SkyRL 0.3.0's protocol) and starts its own server
on a free port (stopped at the end). Warm-up runs come first, so JAX compilation is not timed.
Prints one JSON line.

Usage: .venv-skyrl/bin/python benchmarks/tinker_pipelining.py [--steps 6] [--repeats 2]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import io
import json
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from rllm_async.config import Config, config_from_dict
from rllm_async.protocols import SamplingParams
from rllm_async.types import Step, Trajectory, TrajectoryGroup

REPO = Path(__file__).resolve().parents[1]


def _manage() -> Any:
    spec = importlib.util.spec_from_file_location(
        "manage", REPO / "scripts/tinker_server/manage.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reward(task: dict[str, Any], text: str) -> float:
    """Varies within a group, so that the random policy has advantages (and its weights move)."""
    return float(len(text) % 3)


def _config(url: str, run_dir: Path, name: str, **over: Any) -> Config:
    data: dict[str, Any] = {
        "name": name,
        "mode": "sync",
        "run_dir": str(run_dir),
        "backend": {
            "name": "tinker",
            "base_model": str(_manage().MODEL),
            "base_url": url,
            "api_key": "tml-local-benchmark",
            "lora_rank": 8,
            "server_loss_reduction": "sequence_mean",
            "server_snapshots": False,
            "request_timeout_s": 300,
        },
        "rollout": {"group_size": 4, "max_tokens": 16, "timeout_s": 300},
        "train": {"groups_per_step": 4, "micro_batch_groups": 1},
        "algorithm": {"filter_zero_variance": False, "loss": {"importance_sampling": "none"}},
        "optim": {"lr": 0.01},
        "logging": {"progress_bar": False, "jsonl": False},
        "checkpoint": {"at_end": False, "resume": "never"},
    }
    for key, value in over.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return config_from_dict(data)


def _tasks(n: int) -> list[dict[str, Any]]:
    from rllm_async.tasks.countdown import generator

    return generator(n=n, seed=0)


def train_run(url: str, run_dir: Path, mode: str, steps: int, name: str) -> list[dict[str, float]]:
    """One `UnifiedTrainer` run; returns its step records."""
    from rllm_async.trainer import UnifiedTrainer
    from rllm_async.workflows.single_turn import SingleTurnWorkflow

    coordinator = (
        {"pipeline_depth": 1, "max_staleness": 1, "weight_update": "latest"}
        if mode == "async"
        else {}
    )
    cfg = _config(
        url, run_dir, name, mode=mode, coordinator=coordinator, train={"total_steps": steps}
    )
    trainer = UnifiedTrainer(
        cfg, workflow=SingleTurnWorkflow(_reward), train_tasks=_tasks(4 * steps * 4)
    )
    with contextlib.redirect_stdout(io.StringIO()):
        return trainer.run()


def step_figures(runs: list[list[dict[str, float]]]) -> dict[str, float]:
    """Median per-step figures over steps 2.. of every run."""
    rows = [r for records in runs for r in records[1:]]
    return {
        "step_s_median": statistics.median(r["time/step_s"] for r in rows),
        "step_s_mean": statistics.fmean(r["time/step_s"] for r in rows),
        "trainer_idle_ratio": statistics.fmean(r["async/trainer_idle_ratio"] for r in rows),
        "staleness_mean": statistics.fmean(r["staleness/mean"] for r in rows),
        "tokens_per_s": statistics.fmean(r["tokens/per_s"] for r in rows),
        "steps_timed": len(rows),
    }


async def _fixed_batch(backend: Any, groups: int, group_size: int) -> list[TrajectoryGroup]:
    """`groups` sampled groups of one prompt each, with alternating advantages."""
    policy = backend.policy()
    out = []
    for g in range(groups):
        ids = policy.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"what is {g} plus {g}?"}]
        )
        trajs = []
        for i in range(group_size):
            c = await policy.generate(ids, SamplingParams(max_tokens=16, seed=g * 100 + i))
            trajs.append(Trajectory([Step(ids, c.ids, c.logprobs, c.versions)], reward=i % 2))
        advantages = [1.0 if i % 2 else -1.0 for i in range(group_size)]
        out.append(TrajectoryGroup(f"t{g}", "default", trajs, advantages))
    return out


async def pipelining(url: str, run_dir: Path, micro_batches: int, steps: int) -> dict[str, Any]:
    """Seconds per optimizer step (forward_backward x micro_batches + optim_step), both ways."""
    from rllm_async.backends.tinker import TinkerBackend

    backends = {
        flag: TinkerBackend.from_config(
            _config(
                url,
                run_dir,
                f"pipe-{flag}",
                backend={"pipeline_requests": flag},
                train={"groups_per_step": micro_batches, "micro_batch_groups": 1},
            )
        )
        for flag in (True, False)
    }
    batch = await _fixed_batch(backends[True], micro_batches, 4)
    loss = backends[True].config.algorithm.loss
    times: dict[bool, list[float]] = {True: [], False: []}
    fb_times: dict[bool, list[float]] = {True: [], False: []}
    for step in range(steps + 1):  # step 0 warms up each backend
        for flag, backend in backends.items():
            t0 = time.perf_counter()
            for group in batch:
                await backend.forward_backward([group], loss)
            t1 = time.perf_counter()
            await backend.optim_step()
            t2 = time.perf_counter()
            await backend.on_policy_updated(step + 1)
            if step:
                times[flag].append(t2 - t0)
                fb_times[flag].append(t1 - t0)
    for backend in backends.values():
        await backend.close()
    on, off = statistics.median(times[True]), statistics.median(times[False])
    return {
        "micro_batches": micro_batches,
        "sequences_per_micro_batch": 4,
        "step_s_pipelined": on,
        "step_s_unpipelined": off,
        "hidden_s_per_step": off - on,
        "hidden_fraction": (off - on) / off,
        "fb_calls_s_pipelined": statistics.median(fb_times[True]),
        "fb_calls_s_unpipelined": statistics.median(fb_times[False]),
        "steps_timed": steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per trainer run")
    parser.add_argument("--repeats", type=int, default=2, help="sync/async runs each, alternating")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--pipeline-steps", type=int, default=8)
    args = parser.parse_args()

    manage = _manage()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        t0 = time.perf_counter()
        proc = manage.start(work / "server", port)
        start_s = time.perf_counter() - t0
        url = f"http://127.0.0.1:{port}"
        try:
            t0 = time.perf_counter()
            for mode in ("sync", "async"):  # warm-up: compiles every shape the runs use
                train_run(url, work / "runs", mode, 3, f"warmup-{mode}")
            warmup_s = time.perf_counter() - t0
            runs: dict[str, list[list[dict[str, float]]]] = {"sync": [], "async": []}
            for r in range(args.repeats):
                for mode in ("sync", "async"):
                    runs[mode].append(train_run(url, work / "runs", mode, args.steps, f"{mode}{r}"))
            modes = {mode: step_figures(records) for mode, records in runs.items()}
            pipe = asyncio.run(
                pipelining(url, work / "runs", args.micro_batches, args.pipeline_steps)
            )
        finally:
            manage.stop(proc)
    result = {
        "benchmark": "tinker_pipelining",
        "server": "SkyRL 0.3.0 Tinker API, JAX on CPU, 2-layer hidden-64 Qwen3, LoRA rank 8",
        "workload": {
            "groups_per_step": 4,
            "group_size": 4,
            "micro_batch_groups": 1,
            "max_tokens": 16,
            "steps": args.steps,
            "repeats": args.repeats,
        },
        "sync": modes["sync"],
        "async_d1_latest": modes["async"],
        "async_speedup": modes["sync"]["step_s_median"] / modes["async"]["step_s_median"],
        "pipelining": pipe,
        "server_start_s": start_s,
        "warmup_s": warmup_s,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
