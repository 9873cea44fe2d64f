"""Local backend throughput: our KV-cache sampler vs `transformers` generate() on a same-size model.

Both sample 64 sequences of `--new-tokens` tokens, ours from the `small` preset's architecture and
`transformers` from a Qwen2 config of the same width, depth, heads and vocabulary (random weights),
one torch thread each; after a warm-up, in `--repeats` back-to-back pairs, and the speedup is the
median of the pairs' ratios. Also measures the learner's training tokens/s and the process's peak
memory (and the GPU's, with `--device cuda`). Prints one JSON line. Needs `transformers` (an optional
dependency of this benchmark only).

Usage: python benchmarks/local_throughput.py [--batch 64] [--new-tokens 128] [--repeats 11]
                                            [--device cpu]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import time

import torch

from rllm_async.backends.local.learner import Learner
from rllm_async.backends.local.model import build_model, frozen_copy, preset_config
from rllm_async.backends.local.sampler import Sampler
from rllm_async.backends.local.snapshots import WeightStore
from rllm_async.backends.local.transformers_model import Decoder
from rllm_async.backends.toy_tokenizers import CharTokenizer
from rllm_async.config import LossConfig, OptimConfig
from rllm_async.protocols import SamplingParams
from rllm_async.types import Step, Trajectory, TrajectoryGroup

PROMPT_TOKENS = 16


def ours(batch: int, new_tokens: int, device: torch.device) -> float:
    """Tokens/s of our sampler with `batch` concurrent requests."""
    tok = CharTokenizer()
    model = build_model(preset_config("small", tok.vocab_size), seed=0)
    store = WeightStore(0, frozen_copy(model, device, torch.float32))
    sampler = Sampler(
        store,
        tok,
        stop_ids=(),
        max_batch=batch,
        max_seq_len=PROMPT_TOKENS + new_tokens,
        device=device,
        dtype=torch.float32,
        threads=1,
        seed=0,
    )
    params = SamplingParams(temperature=1.0, max_tokens=new_tokens)
    prompt = tok.encode("x" * PROMPT_TOKENS)

    async def all_at_once() -> int:
        outs = await asyncio.gather(*(sampler.generate(prompt, params) for _ in range(batch)))
        return sum(len(o.ids) for o in outs)

    try:
        t0 = time.perf_counter()
        tokens = asyncio.run(all_at_once())
        return tokens / (time.perf_counter() - t0)
    finally:
        sampler.close()


def hf(batch: int, new_tokens: int, device: torch.device) -> float:
    """Tokens/s of `transformers` generate() on a Qwen2 of the same shape."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = preset_config("small", CharTokenizer().vocab_size)
    model = (
        Qwen2ForCausalLM(
            Qwen2Config(
                vocab_size=cfg.vocab_size,
                hidden_size=cfg.dim,
                intermediate_size=cfg.ffn_dim,
                num_hidden_layers=cfg.n_layers,
                num_attention_heads=cfg.n_heads,
                num_key_value_heads=cfg.kv_heads,
                max_position_embeddings=PROMPT_TOKENS + new_tokens,
                tie_word_embeddings=True,
            )
        )
        .to(device)
        .eval()
    )
    ids = torch.randint(4, cfg.vocab_size, (batch, PROMPT_TOKENS), device=device)
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
        )
        _sync(device)
        elapsed = time.perf_counter() - t0
    return (out.shape[1] - PROMPT_TOKENS) * batch / elapsed


def bench_learner(model: Decoder) -> Learner:
    """The learner the local benchmarks time: AdamW at lr 1e-4, micro-batches of 16, float32."""
    return Learner(
        model,
        OptimConfig(lr=1e-4),
        total_steps=10,
        temperature=1.0,
        train_batch=16,
        compute_dtype=torch.float32,
    )


def training(batch: int, seq_len: int, device: torch.device) -> float:
    """Learner tokens/s (forward + backward + AdamW) on `batch` sequences of `seq_len` tokens."""
    tok = CharTokenizer()
    model = build_model(preset_config("small", tok.vocab_size), seed=0).to(device)
    learner = bench_learner(model)
    half = seq_len // 2
    # Distinct completions after one shared prompt: the learner lays identical sequences out once,
    # so repeats would measure less work than they claim.
    gen = torch.Generator().manual_seed(0)
    completions = torch.randint(4, tok.vocab_size, (batch, half), generator=gen).tolist()
    trajs = [
        Trajectory(steps=[Step([5] * half, c, [-1.0] * half, [0] * half)], reward=float(i % 2))
        for i, c in enumerate(completions)
    ]
    groups = [TrajectoryGroup("t", "default", trajs, [t.reward - 0.5 for t in trajs])]
    learner.forward_backward(groups, LossConfig())  # warm-up
    learner.optim_step()
    t0 = time.perf_counter()
    for _ in range(3):
        learner.forward_backward(groups, LossConfig())
        learner.optim_step()
    _sync(device)
    return 3 * batch * seq_len / (time.perf_counter() - t0)


def _sync(device: torch.device) -> None:
    """Wait for queued GPU work, so that a timer stops when the work is done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=11, help="back-to-back pairs of runs")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    args = parser.parse_args()
    if args.repeats < 2:
        parser.error("--repeats needs at least 2 pairs, for the quartiles of their ratios")
    device = torch.device(args.device)
    torch.set_num_threads(1)
    n, new = args.batch, args.new_tokens
    ours(n, 8, device), hf(n, 8, device)  # warm-up: first-call costs are not throughput
    # Each run takes a second or two, and a shared machine's speed drifts over minutes: the ratio
    # of a back-to-back pair sees the same drift on both sides, and the median of many pairs
    # shrugs off the pairs a burst of load hit on one side only.
    runs = [(ours(n, new, device), hf(n, new, device)) for _ in range(args.repeats)]
    ratios = sorted(o / h for o, h in runs)
    quartiles = statistics.quantiles(ratios, n=4)
    train_tps = training(n, PROMPT_TOKENS + new, device)
    gpu = {}
    if device.type == "cuda":
        gpu = {
            "gpu": torch.cuda.get_device_name(device),
            "peak_gpu_mib": round(torch.cuda.max_memory_allocated(device) / 2**20),
        }
    print(
        json.dumps(
            {
                "device": args.device,
                **gpu,
                "batch": args.batch,
                "new_tokens": args.new_tokens,
                "sampler_tokens_per_s": round(statistics.median(o for o, _ in runs)),
                "hf_generate_tokens_per_s": round(statistics.median(h for _, h in runs)),
                "sampler_speedup_vs_hf": round(statistics.median(ratios), 2),
                "speedup_quartiles": [round(quartiles[0], 2), round(quartiles[2], 2)],
                "speedup_range": [round(ratios[0], 2), round(ratios[-1], 2)],
                "train_tokens_per_s": round(train_tps),
                "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            }
        )
    )


if __name__ == "__main__":
    main()
