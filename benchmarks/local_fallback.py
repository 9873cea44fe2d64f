"""Local backend: our decoder against the transformers fallback, on the same checkpoint.

A tiny random Qwen3 (`rllm_async.models.tiny_qwen`, `--hidden` wide, `--layers` deep) runs on both
paths (`backend.model_impl: native` and `transformers`): the sampler decodes `--batch` requests of
`--new-tokens` tokens together (no stop tokens, one torch thread), and the learner takes a
forward/backward and optimizer step on those sequences in groups of 8 that share a prompt. Reports
each path's sampling and training tokens/s (the best of `--repeats`) and the ratios. Prints one
JSON line.

Usage: python benchmarks/local_fallback.py [--batch 32] [--new-tokens 64] [--hidden 256]
                                           [--layers 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import torch
from local_throughput import bench_learner  # beside this script

from rllm_async.backends.local.hf import load_chat_tokenizer, load_checkpoint
from rllm_async.backends.local.model import load_model
from rllm_async.backends.local.sampler import Sampler
from rllm_async.backends.local.snapshots import WeightStore
from rllm_async.backends.local.transformers_model import (
    Decoder,
    inference_copy,
    load_transformers_model,
)
from rllm_async.config import LossConfig
from rllm_async.models.tiny_qwen import build_tiny_qwen
from rllm_async.protocols import SamplingParams
from rllm_async.types import Step, Trajectory, TrajectoryGroup

CPU = torch.device("cpu")
PROMPT = "Write a short story about a robot."
GROUP = 8


def load(path: Path, impl: str) -> Decoder:
    if impl == "native":
        ckpt = load_checkpoint(path)
        return load_model(ckpt.config, ckpt.state, CPU, torch.float32)
    return load_transformers_model(path, CPU)


def sample(path: Path, model: Decoder, batch: int, new_tokens: int) -> tuple[float, list]:
    """Tokens/s of `batch` concurrent requests, and their (prompt, completion) pairs."""
    tokenizer, _ = load_chat_tokenizer(path)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    sampler = Sampler(
        WeightStore(0, inference_copy(model, CPU, torch.float32)),
        tokenizer,
        stop_ids=(),
        max_batch=batch,
        max_seq_len=len(prompt) + new_tokens,
        device=CPU,
        dtype=torch.float32,
        threads=1,
        seed=0,
    )
    params = [SamplingParams(max_tokens=new_tokens, seed=i) for i in range(batch)]

    async def run() -> list:
        return await asyncio.gather(*(sampler.generate(prompt, p) for p in params))

    try:
        start = time.perf_counter()
        outs = asyncio.run(run())
        elapsed = time.perf_counter() - start
    finally:
        sampler.close()
    return sum(len(o.ids) for o in outs) / elapsed, [(prompt, o) for o in outs]


def train(model: Decoder, samples: list) -> float:
    """Trained tokens/s of one forward/backward and optimizer step over `samples`."""
    learner = bench_learner(model)
    groups = []
    for g in range(0, len(samples), GROUP):
        trajs = [
            Trajectory(steps=[Step(p, o.ids, o.logprobs, o.versions)])
            for p, o in samples[g : g + GROUP]
        ]
        adv = [float(i % 2) - 0.5 for i in range(len(trajs))]
        groups.append(TrajectoryGroup(str(g), "default", trajs, adv))
    start = time.perf_counter()
    metrics = learner.forward_backward(groups, LossConfig())
    learner.optim_step()
    return metrics["loss/num_tokens"] / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    result: dict[str, float | int | str] = {
        "model": f"random Qwen3, hidden {args.hidden}, {args.layers} layers",
        "batch": args.batch,
        "new_tokens": args.new_tokens,
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_qwen(Path(tmp), hidden=args.hidden, layers=args.layers)
        for impl in ("native", "transformers"):
            best_sample = best_train = 0.0
            for _ in range(args.repeats):
                model = load(path, impl)
                tokens_s, samples = sample(path, model, args.batch, args.new_tokens)
                best_sample = max(best_sample, tokens_s)
                best_train = max(best_train, train(model, samples))
            result[f"{impl}_sample_tokens_s"] = round(best_sample, 1)
            result[f"{impl}_train_tokens_s"] = round(best_train, 1)
    for kind in ("sample", "train"):
        ratio = result[f"native_{kind}_tokens_s"] / result[f"transformers_{kind}_tokens_s"]  # type: ignore[operator]
        result[f"{kind}_native_over_transformers"] = round(ratio, 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
