"""One decode step of the `small` preset's sampler, by how the batch's cache slots lie.

In a training run the batch's slots are rarely one full run: requests leave at different steps,
queued ones fill the freed slots, and pinned episodes split a batch by weight version. This times
`Transformer.hidden` + `lm_head` over a `CacheView` of a 128-slot cache (96 positions), one torch
thread, rows at position 36 (the main job's prompts are about 31 tokens), for several layouts:
a full run, a shorter run, a run with gaps, random slots, and two or three interleaved versions
(one pass each). Prints one JSON line of median milliseconds per layout.

Usage: python benchmarks/decode_step.py [--repeats 60]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from rllm_async.backends.local.cache import CacheView, KVCache
from rllm_async.backends.local.model import build_model, preset_config
from rllm_async.backends.toy_tokenizers import CharTokenizer

MAX_BATCH, MAX_SEQ_LEN, POSITION = 128, 96, 36


def layouts() -> dict[str, list[list[int]]]:
    """Slot sets of one decode step, one list per forward pass."""
    rng = random.Random(0)
    return {
        "run_128": [list(range(128))],
        "run_124": [list(range(124))],
        "run_100": [list(range(100))],
        "gaps_120_of_128": [sorted(rng.sample(range(128), 120))],
        "random_64_of_128": [sorted(rng.sample(range(128), 64))],
        "random_16_of_128": [sorted(rng.sample(range(128), 16))],
        "versions_2x64": [list(range(0, 128, 2)), list(range(1, 128, 2))],
        "versions_3x43": [list(range(v, 128, 3)) for v in range(3)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tok = CharTokenizer()
    model = build_model(preset_config("small", tok.vocab_size), seed=0).eval()
    cfg = model.cfg
    cache = KVCache(
        n_layers=cfg.n_layers,
        max_batch=MAX_BATCH,
        n_kv_heads=cfg.kv_heads,
        max_seq_len=MAX_SEQ_LEN,
        head_dim=cfg.hdim,
        device=torch.device("cpu"),
        dtype=torch.float32,
    )
    cache.k.normal_()
    cache.v.normal_()

    def step(passes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        for slots, tokens, positions in passes:
            view = CacheView(cache, slots, positions)
            model.lm_head(model.hidden(tokens, view)[:, -1])

    out: dict[str, float] = {}
    with torch.inference_mode():
        for name, slot_sets in layouts().items():
            passes = [
                (
                    torch.tensor(slots),
                    torch.randint(10, cfg.vocab_size, (len(slots), 1)),
                    torch.full((len(slots), 1), POSITION),
                )
                for slots in slot_sets
            ]
            for _ in range(5):
                step(passes)
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                step(passes)
                times.append(time.perf_counter() - t0)
            out[f"{name}_ms"] = round(statistics.median(times) * 1000, 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
