"""The local backend at a real size on one GPU: a random Qwen3-0.6B-shaped checkpoint, sampled and
trained through `LocalBackend` exactly as `rllm-async train` builds it.

What. A randomly initialised Qwen3 with Qwen3-0.6B's published shape (hidden 1024, 28 layers, 16
query and 8 key/value heads of 128, MLP 3072, vocabulary 151,936, tied embeddings) is written with
`save_pretrained` (bfloat16) beside the byte-level BPE tokenizer of `rllm_async.models.tiny_qwen`
(its ~1k ids lie inside the model's vocabulary), then loaded as `backend.model_path`. Measured:
the sampler's tokens/s (`--batch` concurrent requests per round, groups of `--group-size` sharing a
random `--prompt-tokens` prompt, exactly `--new-tokens` each unless the stop token comes up), the
learner's tokens/s (`forward_backward` over the last round's groups as GRPO groups, then
`optim_step`, after one warm-up step), the weight sync (`on_policy_updated`: a bfloat16 snapshot
for the sampler), and peak GPU memory per phase (`torch.cuda.max_memory_allocated`; the process's
peak RSS on a CPU). Prints one JSON line. Nothing is downloaded.

Why. The GPU recipes (examples/gpu/, docs/gpu.md) size `max_batch`, `train_batch` and the group
layout for this model; this shows what they cost on the card before a real run does.

Usage: python benchmarks/gpu_local.py [--device cuda] [--batch 64 128 256] [--new-tokens 256]
                                      [--prompt-tokens 128] [--group-size 8] [--train-batch 16]
                                      [--train-steps 3] [--hidden 1024] [--layers 28]
The code path on a CPU, at a tiny size (about 10 s on 2 cores):
       python benchmarks/gpu_local.py --device cpu --hidden 128 --layers 2 --vocab 2048 \
           --batch 4 8 --new-tokens 16 --prompt-tokens 16 --group-size 4 --train-steps 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from rllm_async.backends.local.backend import LocalBackend
from rllm_async.config import LossConfig, config_from_dict
from rllm_async.models.tiny_qwen import build_tokenizer
from rllm_async.protocols import Completion, SamplingParams
from rllm_async.types import Step, Trajectory, TrajectoryGroup

HEAD_DIM = 128  # Qwen3-0.6B's (and 1.7B's): heads are wider than hidden / heads


def build_checkpoint(out: Path, args: argparse.Namespace, device: torch.device) -> dict[str, int]:
    """Write a random Qwen3 of the requested shape (bfloat16) and a tokenizer to `out`; its shape.

    The weights are initialised on `device` (a 0.6B model initialises in seconds on a GPU, tens of
    seconds on a CPU) and written once; the backend then loads them as any checkpoint.
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    tokens = build_tokenizer(out)
    if tokens > args.vocab:
        raise SystemExit(f"--vocab {args.vocab} is smaller than the tokenizer's {tokens} ids")
    ids = {
        t["content"]: t["id"]
        for t in json.loads((out / "tokenizer.json").read_text())["added_tokens"]
    }
    heads = args.heads or max(1, args.hidden // 64)  # 16 at Qwen3-0.6B's hidden 1024
    shape = {
        "hidden": args.hidden,
        "layers": args.layers,
        "heads": heads,
        "kv_heads": max(1, heads // 2),
        "head_dim": HEAD_DIM,
        "intermediate": args.intermediate or 3 * args.hidden,
        "vocab": args.vocab,
        "tokenizer_ids": tokens,
    }
    config = Qwen3Config(
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        head_dim=HEAD_DIM,
        max_position_embeddings=40960,  # the RoPE base is left at its default: it costs nothing
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        bos_token_id=None,
        dtype="bfloat16",
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).bfloat16()
    model.save_pretrained(str(out), safe_serialization=True)
    shape["params"] = sum(p.numel() for p in model.parameters())  # tied: embeddings once
    del model
    return shape


def bench_config(ckpt: Path, run_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The run config the backend is built from: the recipes' local-backend choices."""
    return {
        "name": "gpu-local-bench",
        "run_dir": str(run_dir),
        "backend": {
            "name": "local",
            "model_path": str(ckpt),
            "device": args.device,
            "dtype": args.dtype,
            "max_batch": max(args.batch),
            "train_batch": args.train_batch,
            "max_seq_len": args.prompt_tokens + args.new_tokens + 1,
        },
        "rollout": {"group_size": args.group_size, "max_tokens": args.new_tokens},
        "train": {"total_steps": 100},
        "optim": {"lr": 1e-6, "grad_clip": 1.0},
    }


async def sample_round(
    backend: LocalBackend, batch: int, args: argparse.Namespace, rng: random.Random, vocab: int
) -> tuple[list[tuple[list[int], list[Completion]]], float]:
    """`batch` concurrent requests, in groups that share a prompt; the groups and the seconds."""
    params = SamplingParams(temperature=1.0, max_tokens=args.new_tokens)
    prompts = [
        [rng.randrange(vocab) for _ in range(args.prompt_tokens)]
        for _ in range(max(1, batch // args.group_size))
    ]
    policy = backend.policy()
    t0 = time.perf_counter()
    outs = await asyncio.gather(
        *(policy.generate(p, params) for p in prompts for _ in range(args.group_size))
    )
    _sync(backend.device)
    seconds = time.perf_counter() - t0
    k = args.group_size
    return [(p, list(outs[i * k : (i + 1) * k])) for i, p in enumerate(prompts)], seconds


def as_groups(sampled: list[tuple[list[int], list[Completion]]]) -> list[TrajectoryGroup]:
    """The sampled completions as GRPO groups: alternating rewards, advantages about the mean."""
    groups = []
    for g, (prompt, completions) in enumerate(sampled):
        trajs = [
            Trajectory(steps=[Step(prompt, c.ids, c.logprobs, c.versions)], reward=float(i % 2))
            for i, c in enumerate(completions)
        ]
        mean = statistics.fmean(t.reward for t in trajs)
        groups.append(TrajectoryGroup(f"t{g}", "default", trajs, [t.reward - mean for t in trajs]))
    return groups


async def train_step(
    backend: LocalBackend, groups: list[TrajectoryGroup], micro: int
) -> dict[str, float]:
    """One optimizer step over `groups`, `micro` groups per `forward_backward`; its metrics."""
    metrics: dict[str, float] = {}
    for start in range(0, len(groups), micro):
        fb = await backend.forward_backward(groups[start : start + micro], LossConfig())
        metrics.setdefault("sampler_kl", fb.get("loss/sampler_kl", float("nan")))
    metrics.update(await backend.optim_step())
    return metrics


def _sync(device: torch.device) -> None:
    """Wait for queued GPU work, so that a timer stops when the work is done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_mib(device: torch.device) -> int:
    """Peak GPU memory allocated since the last reset (the process's peak RSS on a CPU)."""
    if device.type == "cuda":
        return round(torch.cuda.max_memory_allocated(device) / 2**20)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


async def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Build, load, sample, train and sync; the figures of the JSON line."""
    device = torch.device(args.device)
    t0 = time.perf_counter()
    shape = build_checkpoint(tmp / "ckpt", args, device)
    build_s = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.empty_cache()
        _reset_peak(device)
    t0 = time.perf_counter()
    config = config_from_dict(bench_config(tmp / "ckpt", tmp / "runs", args))
    backend = LocalBackend.from_config(config)
    load_s = time.perf_counter() - t0
    peak_load = _peak_mib(device)
    try:
        rng = random.Random(0)
        vocab = shape["tokenizer_ids"]  # prompts of ids the tokenizer has
        await sample_round(backend, min(args.batch), _warm_args(args), rng, vocab)  # warm-up
        sampler: dict[str, Any] = {}
        sampled: list[tuple[list[int], list[Completion]]] = []
        for batch in args.batch:
            _reset_peak(device)
            sampled, seconds = await sample_round(backend, batch, args, rng, vocab)
            tokens = sum(len(c.ids) for _, cs in sampled for c in cs)
            sampler[str(batch)] = {
                "tokens": tokens,
                "seconds": round(seconds, 3),
                "tokens_per_s": round(tokens / seconds),
                "peak_batch": backend.sampler.peak_batch,
                "peak_mib": _peak_mib(device),
            }
        groups = as_groups(sampled)
        seq_tokens = sum(len(p) + len(c.ids) for p, cs in sampled for c in cs)
        loss_tokens = sum(len(c.ids) for _, cs in sampled for c in cs)
        _reset_peak(device)
        first = await train_step(backend, groups, args.micro_batch_groups)  # warm-up: AdamW state
        await backend.on_policy_updated(1)
        step_s, sync_s = [], []
        for i in range(args.train_steps):
            _sync(device)
            t0 = time.perf_counter()
            await train_step(backend, groups, args.micro_batch_groups)
            _sync(device)
            step_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await backend.on_policy_updated(i + 2)
            _sync(device)
            sync_s.append(time.perf_counter() - t0)
        peak_train = _peak_mib(device)
    finally:
        await backend.close()
    step = statistics.median(step_s)
    return {
        "model": {**shape, "dtype": args.dtype},
        "build_s": round(build_s, 1),
        "load_s": round(load_s, 1),
        "peak_mib_after_load": peak_load,
        "sampler": {"prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, **sampler},
        "learner": {
            "groups": len(groups),
            "group_size": args.group_size,
            "train_batch": args.train_batch,
            "micro_batch_groups": args.micro_batch_groups,
            "tokens_per_step": seq_tokens,
            "loss_tokens_per_step": loss_tokens,
            "step_s": round(step, 3),
            "tokens_per_s": round(seq_tokens / step),
            "loss_tokens_per_s": round(loss_tokens / step),
            "first_step_sampler_kl": first["sampler_kl"],
            "grad_norm": round(first["optim/grad_norm"], 4),
            "peak_mib": peak_train,
        },
        "sync_s": round(statistics.median(sync_s), 3),
        # The largest of the phases' peaks (on a CPU: the process's peak RSS, which only grows).
        "peak_mib": max([peak_load, peak_train, *(s["peak_mib"] for s in sampler.values())]),
    }


def _warm_args(args: argparse.Namespace) -> argparse.Namespace:
    """A short round's arguments: first-call costs (kernels, allocator) are not throughput."""
    return argparse.Namespace(**{**vars(args), "new_tokens": min(8, args.new_tokens)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--train-batch", type=int, default=16, help="sequences per fwd/bwd chunk")
    parser.add_argument("--micro-batch-groups", type=int, default=4)
    parser.add_argument("--train-steps", type=int, default=3, help="timed, after one warm-up")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--heads", type=int, default=None, help="default: hidden // 64")
    parser.add_argument("--intermediate", type=int, default=None, help="default: 3 x hidden")
    parser.add_argument("--vocab", type=int, default=151936)
    args = parser.parse_args()
    if args.train_steps < 1:
        parser.error("--train-steps must be at least 1")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rllm-gpu-local-") as tmp:
        result = asyncio.run(run(args, Path(tmp)))
    device = torch.device(args.device)
    gpu = {"gpu": torch.cuda.get_device_name(device)} if device.type == "cuda" else {}
    versions = {"torch": torch.__version__}
    print(
        json.dumps(
            {
                "device": args.device,
                **gpu,
                **versions,
                **result,
                "total_s": round(time.perf_counter() - start, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
