"""GRPO step time with each rollout engine: `rllm-async train` with `backend.rollout: local`, then
with `backend.rollout: vllm`, the same config otherwise; one JSON line.

    python benchmarks/engine_step.py --model DIR|FILE.gguf [--steps 6] [--group-size 8]
                                     [--groups-per-step 4] [--max-tokens 32]

Async mode (`pipeline_depth: 1`, `weight_update: latest`), the local learner (float32, one torch
thread), the task set of `tests/integration/vllm/tasks.py` (the reward is the reply's length parity, so
groups have signal); every step is trained, learning or not (`filter_zero_variance: false`). The
vLLM server (`.venv-vllm/`, `python scripts/vllm_env.py setup`) serves bfloat16 and reloads the
learner's weights from /dev/shm after every step. Figures are medians over the steps of
metrics.jsonl, without the first one (it includes warm-up); `run_s` is the whole command, server
start included.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from rllm_async.backends.local.hf import checkpoint_dir

REPO = Path(__file__).resolve().parents[1]
RLLM = Path(sys.executable).parent / "rllm-async"
KEYS = ("time/step_s", "time/sync_s", "time/forward_backward_s")


def write_config(tmp: Path, model: Path, rollout: str, args: argparse.Namespace) -> Path:
    config = {
        "name": f"engine-{rollout}",
        "mode": "async",
        "seed": 0,
        "run_dir": str(tmp / "runs"),
        "backend": {
            "name": "local",
            "model_path": str(model),
            "max_seq_len": 256,
            "rollout": rollout,
            "vllm": {"dtype": "bfloat16"},
        },
        "workflow": {
            "cls": "rllm_async.workflows.SingleTurnWorkflow",
            "args": {"reward_fn": "tests.integration.vllm.tasks:reward"},
        },
        "data": {"train": {"generator": "tests.integration.vllm.tasks:generator"}},
        "rollout": {
            "group_size": args.group_size,
            "max_tokens": args.max_tokens,
            "timeout_s": 600,
            "retries": 1,
        },
        "coordinator": {"pipeline_depth": 1, "max_staleness": 2, "weight_update": "latest"},
        "algorithm": {"filter_zero_variance": False},
        "train": {"total_steps": args.steps, "groups_per_step": args.groups_per_step},
        "checkpoint": {"at_end": False},
        "logging": {"progress_bar": False},
    }
    path = tmp / f"{rollout}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def run(tmp: Path, model: Path, rollout: str, args: argparse.Namespace) -> dict[str, Any]:
    config = write_config(tmp, model, rollout, args)
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # the task module
    start = time.perf_counter()
    proc = subprocess.run(
        [str(RLLM), "train", str(config)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    run_s = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"rllm-async train ({rollout}) failed:\n{proc.stdout[-4000:]}")
    metrics = tmp / "runs" / f"engine-{rollout}" / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    out: dict[str, Any] = {"steps": len(records), "run_s": round(run_s, 1)}
    for key in KEYS:
        name = key.removeprefix("time/")
        out[name] = round(statistics.median(r[key] for r in records[1:]), 3)
    out["step_s_each"] = [round(r["time/step_s"], 2) for r in records]
    out["tokens_per_step"] = round(statistics.median(r["loss/num_tokens"] for r in records[1:]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="checkpoint dir or .gguf file")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--groups-per-step", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    model = checkpoint_dir(args.model)  # dequantize a .gguf once, before either run
    figures = {}
    for rollout in ("local", "vllm"):
        with tempfile.TemporaryDirectory() as tmp:
            figures[rollout] = run(Path(tmp), model, rollout, args)
    print(
        json.dumps(
            {
                "benchmark": "engine_step",
                "model": str(args.model),
                "steps": args.steps,
                "group_size": args.group_size,
                "groups_per_step": args.groups_per_step,
                "max_tokens": args.max_tokens,
                **figures,
            }
        )
    )


if __name__ == "__main__":
    main()
