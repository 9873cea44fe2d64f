"""Where a countdown policy wins and loses: held-out accuracy by kind of problem.

Loads a run's config and checkpoint (the latest unless `--checkpoint`) into the local backend and
scores every held-out problem greedily, as `rllm-async eval` does, then splits the result by kind:
two-number sums, products and differences (those whose larger number comes second apart, since
the model must swap them) and three-number problems. With `--samples N` it also draws N samples
at temperature 1 per problem and reports, per kind, the share of correct samples, the share of
problems with at least one (what a GRPO group of N needs to learn anything) and how often each
operator follows the first number. Prints one JSON line.

Usage: python benchmarks/countdown_breakdown.py RUN_DIR [--checkpoint DIR] [--samples 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from rllm_async.backends.local import LocalBackend
from rllm_async.checkpoint import latest as latest_checkpoint
from rllm_async.config import load_config
from rllm_async.data import load_tasks
from rllm_async.protocols import SamplingParams
from rllm_async.tasks import countdown


def kind(task: dict[str, Any]) -> str:
    """The kind of problem: `3+ numbers`, or which operations solve a two-number one."""
    numbers, target = [int(x) for x in task["numbers"]], int(task["target"])
    if len(numbers) != 2:
        return f"{len(numbers)} numbers"
    a, b = numbers
    kinds = [name for name, ok in (("sum", a + b), ("product", a * b)) if ok == target]
    if a - b == target:
        kinds.append("difference")
    elif b - a == target:
        kinds.append("difference, swapped")
    return " or ".join(kinds)


async def breakdown(run_dir: Path, checkpoint: Path | None, samples: int) -> dict[str, Any]:
    config = load_config(run_dir / "config.yaml", ["logging.progress_bar=false"])
    assert config.data.eval is not None, f"{run_dir}/config.yaml has no data.eval"
    tasks = load_tasks(config.data.eval, "eval")
    checkpoint = checkpoint or latest_checkpoint(run_dir)
    assert checkpoint is not None, f"{run_dir} has no checkpoint"
    backend = LocalBackend.from_config(config)
    try:
        await backend.load(checkpoint / "backend")
        policy = backend.policy()
        tokenizer = policy.tokenizer
        max_tokens = config.rollout.max_tokens

        async def replies(task: dict[str, Any], n: int, temperature: float) -> list[str]:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": task["prompt"]}])
            params = SamplingParams(temperature=temperature, max_tokens=max_tokens)
            outs = await asyncio.gather(*(policy.generate(prompt, params) for _ in range(n)))
            return [tokenizer.decode(o.ids).strip() for o in outs]

        greedy = await asyncio.gather(*(replies(t, 1, 0.0) for t in tasks))
        sampled = (
            await asyncio.gather(*(replies(t, samples, 1.0) for t in tasks)) if samples else []
        )
    finally:
        await backend.close()

    by_kind: dict[str, dict[str, Any]] = defaultdict(lambda: {"n": 0, "greedy": 0.0})
    for i, task in enumerate(tasks):
        row = by_kind[kind(task)]
        row["n"] += 1
        row["greedy"] += countdown.reward(task, greedy[i][0])[1]
        if samples:
            hits = [countdown.reward(task, reply)[1] for reply in sampled[i]]
            row["sampled"] = row.get("sampled", 0.0) + sum(hits) / samples
            row["any_correct"] = row.get("any_correct", 0.0) + any(hits)
            ops = row.setdefault("operator_after_first_number", Counter())
            ops.update(_operator(reply) for reply in sampled[i])
    for row in by_kind.values():
        for key in ("greedy", "sampled", "any_correct"):
            if key in row:
                row[key] = round(row[key] / row["n"], 3)
        if "operator_after_first_number" in row:
            ops = row["operator_after_first_number"]
            total = sum(ops.values())
            row["operator_after_first_number"] = {
                op: round(count / total, 3) for op, count in ops.most_common()
            }
    accuracy = sum(row["greedy"] * row["n"] for row in by_kind.values()) / len(tasks)
    return {
        "checkpoint": str(checkpoint),
        "accuracy": round(accuracy, 4),
        "samples": samples,
        "kinds": dict(sorted(by_kind.items())),
    }


def _operator(reply: str) -> str:
    """The first operator in a reply (`other` if there is none before anything else)."""
    rest = reply.lstrip("(0123456789")
    return rest[0] if rest and rest[0] in countdown.OPS else "other"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--checkpoint", type=Path, default=None)
    parser.add_argument("--samples", type=int, default=0, help="samples per problem at T=1")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(breakdown(args.run_dir, args.checkpoint, args.samples))))


if __name__ == "__main__":
    main()
