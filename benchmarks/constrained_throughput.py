"""Local sampler throughput with and without grammar constraints, and a constraint's compile time.

A batch of `--batch` requests decodes `--new-tokens` tokens each, all free or all under a JSON
schema (an array of at least 100 objects with a bounded string, an enum and a bounded integer, so
that no reply ends before `--new-tokens`: both batches decode the same tokens), on the main job's
model (the `small` preset, 1M parameters, character vocabulary) or, with `--model-path`, a
checkpoint the local backend loads (SmolLM2's GGUF: a 49,152-token vocabulary, whose masks cost
more). Free and constrained batches alternate after a warm-up; the ratio is the median of the
pairs'. Compile time: the first `Grammars.matcher` of a new schema (compiled and checked against
the vocabulary), and a matcher of a schema already compiled (cached per schema). One JSON line.

Usage: python benchmarks/constrained_throughput.py [--batch 64] [--new-tokens 64] [--pairs 5]
                                                   [--model-path PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import torch

from rllm_async.backends.local import LocalBackend
from rllm_async.backends.local.sampler import Sampler
from rllm_async.config import config_from_dict
from rllm_async.protocols import SamplingParams

ITEM = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
SCHEMA = {"type": "array", "items": ITEM, "minItems": 100}


def backend(batch: int, new_tokens: int, model_path: str | None) -> LocalBackend:
    model: dict[str, Any] = {"model_path": model_path} if model_path else {"model": "small"}
    cfg = config_from_dict(
        {
            "backend": {
                "name": "local",
                "max_batch": batch,
                "max_seq_len": 64 + new_tokens,
                **model,
            },
            "rollout": {"max_tokens": new_tokens},
        }
    )
    return LocalBackend.from_config(cfg)


def sampler(be: LocalBackend, batch: int, new_tokens: int) -> Sampler:
    """A sampler over the backend's weights that never stops before `new_tokens` (no stop ids),
    one torch thread, in the backend's dtype."""
    return Sampler(
        be.store,
        be.policy().tokenizer,
        stop_ids=(),
        max_batch=batch,
        max_seq_len=64 + new_tokens,
        device=torch.device("cpu"),
        dtype=be.dtype,
        threads=1,
        seed=0,
    )


async def tokens_per_s(s: Sampler, batch: int, params: SamplingParams) -> float:
    prompt = s.tokenizer.apply_chat_template([{"role": "user", "content": "weather?"}])
    start = time.perf_counter()
    outs = await asyncio.gather(*(s.generate(prompt, params.updated(seed=i)) for i in range(batch)))
    elapsed = time.perf_counter() - start
    assert all(o.finish_reason == "length" for o in outs), "a reply ended early"
    return sum(len(o.ids) for o in outs) / elapsed


def compile_times(s: Sampler) -> dict[str, float]:
    grammars = s.grammars()
    fresh = json.dumps({"json": {**SCHEMA, "description": "a schema not compiled before"}})
    start = time.perf_counter()
    grammars.matcher(fresh)
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(100):
        grammars.matcher(fresh)
    cached = (time.perf_counter() - start) / 100
    return {"compile_ms": round(first * 1e3, 2), "cached_matcher_ms": round(cached * 1e3, 3)}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    be = backend(args.batch, args.new_tokens, args.model_path)
    s = sampler(be, args.batch, args.new_tokens)
    free = SamplingParams(temperature=1.0, max_tokens=args.new_tokens, stop=())
    constrained = free.updated(structured=json.dumps({"json": SCHEMA}))
    await tokens_per_s(s, args.batch, free)  # warm-up, and the tokenizer's grammar engine
    await tokens_per_s(s, args.batch, constrained)
    pairs = []
    for _ in range(args.pairs):
        pairs.append(
            (
                await tokens_per_s(s, args.batch, free),
                await tokens_per_s(s, args.batch, constrained),
            )
        )
    compile_ = compile_times(s)
    s.close()
    await be.close()
    ratios = [c / f for f, c in pairs]
    return {
        "benchmark": "constrained_throughput",
        "model": args.model_path or "small",
        "batch": args.batch,
        "new_tokens": args.new_tokens,
        "free_tokens_per_s": round(statistics.median(f for f, _ in pairs), 1),
        "constrained_tokens_per_s": round(statistics.median(c for _, c in pairs), 1),
        "ratio": round(statistics.median(ratios), 3),
        "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
        **compile_,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--model-path", default=None)
    print(json.dumps(asyncio.run(main(parser.parse_args()))))
