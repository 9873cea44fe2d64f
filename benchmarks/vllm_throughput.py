"""vLLM engine throughput: a real vLLM server through `VLLMPolicy` vs the local sampler, same model.

Both sample `--batch` concurrent requests of up to `--new-tokens` tokens (a completion may end
early at the model's end-of-turn token; tokens/s counts the tokens produced) from the tiny random
Qwen3 of `rllm_async.models.tiny_qwen` (or `--model`: a checkpoint directory, or a `.gguf` file
dequantized once into the project's cache), after a warm-up, `--repeats` times
each; figures are medians. Also the weight sync (`update_weights`: pause, reload from /dev/shm,
relabel, resume), idle and during a full batch. The server needs `.venv-vllm/`
(`python scripts/vllm_env.py setup`). Prints one JSON line.

Usage: python benchmarks/vllm_throughput.py [--batch 64] [--new-tokens 128] [--repeats 3]
                                           [--dtype bfloat16] [--model DIR|FILE.gguf]
                                           [--local-dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

from rllm_async.backends.local.hf import checkpoint_dir, load_checkpoint
from rllm_async.backends.local.model import frozen_copy, load_model
from rllm_async.backends.local.sampler import Sampler
from rllm_async.backends.local.snapshots import WeightStore
from rllm_async.engines.vllm import VLLMPolicy, VLLMServer, write_weights
from rllm_async.models.tiny_qwen import build_tiny_qwen
from rllm_async.protocols import Completion, SamplingParams

PROMPT = [{"role": "user", "content": "what is 12 plus 30? think step by step."}]


Generate = Callable[[list[int], SamplingParams], Awaitable[Completion]]


async def tokens_per_s(generate: Generate, prompt: list[int], batch: int, new_tokens: int) -> float:
    """Tokens/s of `batch` concurrent requests of up to `new_tokens` tokens each."""
    params = SamplingParams(temperature=1.0, max_tokens=new_tokens)
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(generate(prompt, params) for _ in range(batch)))
    return sum(len(o.ids) for o in outs) / (time.perf_counter() - t0)


async def vllm_figures(model: Path, args: argparse.Namespace, logs: Path) -> dict[str, float]:
    """Tokens/s through `VLLMPolicy`, and weight-sync seconds idle and under load."""
    server = VLLMServer(model, log_path=logs / "vllm-0.log", dtype=args.dtype, max_model_len=1024)
    start = time.perf_counter()
    await server.start()
    startup = time.perf_counter() - start
    tok = load_checkpoint(model).tokenizer
    try:
        async with VLLMPolicy([server.url], tok, max_context_tokens=1024) as policy:
            prompt = tok.apply_chat_template(PROMPT)
            await tokens_per_s(policy.generate, prompt, args.batch, 8)  # warm-up
            runs = [
                await tokens_per_s(policy.generate, prompt, args.batch, args.new_tokens)
                for _ in range(args.repeats)
            ]
            state = load_file(str(model / "model.safetensors"))
            with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
                weights = write_weights(state, Path(shm) / "weights", config=model / "config.json")
                idle = [
                    (await policy.update_weights(weights, v, mode="keep")).seconds
                    for v in range(1, 6)
                ]
                load = asyncio.ensure_future(
                    tokens_per_s(policy.generate, prompt, args.batch, args.new_tokens)
                )
                await asyncio.sleep(0.5)
                busy = (await policy.update_weights(weights, 6, mode="keep")).seconds
                await load
    finally:
        server.stop()
    return {
        "vllm_startup_s": round(startup, 1),
        "vllm_tokens_per_s": round(statistics.median(runs)),
        "vllm_sync_idle_s": round(statistics.median(idle), 3),
        "vllm_sync_under_load_s": round(busy, 3),
    }


async def local_figure(model: Path, args: argparse.Namespace, dtype: torch.dtype) -> float:
    """Tokens/s of the local sampler (one torch thread, weights and cache in `dtype`) on the same
    checkpoint."""
    ckpt = load_checkpoint(model)
    cpu = torch.device("cpu")
    net = load_model(ckpt.config, ckpt.state, cpu, torch.float32)
    sampler = Sampler(
        WeightStore(0, frozen_copy(net, cpu, dtype)),
        ckpt.tokenizer,
        ckpt.stop_ids,
        max_batch=args.batch,
        max_seq_len=1024,
        device=cpu,
        dtype=dtype,
        threads=1,
        seed=0,
    )
    prompt = ckpt.tokenizer.apply_chat_template(PROMPT)
    try:
        await tokens_per_s(sampler.generate, prompt, args.batch, 8)  # warm-up
        runs = [
            await tokens_per_s(sampler.generate, prompt, args.batch, args.new_tokens)
            for _ in range(args.repeats)
        ]
    finally:
        sampler.close()
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", help="the vLLM server's dtype")
    parser.add_argument(
        "--local-dtypes", default="float32", help="the local sampler's, comma-separated"
    )
    parser.add_argument(
        "--model", type=Path, help="a checkpoint directory or .gguf file (default: tiny Qwen3)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = (
            checkpoint_dir(args.model) if args.model else build_tiny_qwen(Path(tmp) / "tiny-qwen")
        )
        figures = asyncio.run(vllm_figures(model, args, Path(tmp)))
        local = {
            name: asyncio.run(local_figure(model, args, getattr(torch, name)))
            for name in args.local_dtypes.split(",")
        }
    vllm = figures["vllm_tokens_per_s"]
    print(
        json.dumps(
            {
                "model": str(args.model) if args.model else "tiny-qwen3 (hidden 256, 2 layers)",
                "batch": args.batch,
                "new_tokens": args.new_tokens,
                "vllm_dtype": args.dtype,
                **figures,
                **{f"local_{name}_tokens_per_s": round(t) for name, t in local.items()},
                **{
                    f"vllm_speedup_vs_local_{name}": round(vllm / t, 2) for name, t in local.items()
                },
            }
        )
    )


if __name__ == "__main__":
    main()
