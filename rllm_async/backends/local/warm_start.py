"""A brief supervised warm start, so that RL begins from a policy that sometimes succeeds.

Its result is cached under a key made of everything that determines it (model and its parameter
layout, seed, the examples' tokens, steps, learning rate), so a second run with the same settings
starts at once.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from rllm_async.backends.local.transformers_model import Decoder
from rllm_async.imports import import_object
from rllm_async.protocols import Tokenizer


class WarmStartOptions(BaseModel):
    """`backend.warm_start`: supervised fine-tuning on chat transcripts before RL."""

    model_config = ConfigDict(extra="forbid")

    examples: str  # import path of a callable returning [{"messages": [..., assistant reply]}]
    args: dict[str, Any] = Field(default_factory=dict)
    steps: int = Field(default=200, ge=1)
    batch_size: int = Field(default=32, ge=1)
    lr: float = Field(default=3e-3, gt=0.0)
    cache_dir: str = "runs/.cache/warm_start"


def warm_start(
    model: Decoder,
    tokenizer: Tokenizer,
    opts: WarmStartOptions,
    *,
    identity: dict[str, Any],
    seed: int,
) -> Path:
    """Fine-tune `model` in place on the examples, or load the cached result; returns the cache file.

    `identity` names the starting model (preset or path, and init seed) for the cache key.
    """
    examples = import_object(opts.examples, "backend.warm_start.examples")(**opts.args)
    sequences = [_tokens(tokenizer, ex) for ex in examples]
    if not sequences:
        raise ValueError(f"backend.warm_start.examples ({opts.examples}) returned no examples")
    # The key holds the tokens themselves, not just the generator's name and arguments: a change
    # to the task's code or to the tokenizer must not load weights trained on other text.
    recipe = {
        "model": identity,
        "layout": {name: list(t.shape) for name, t in model.state_dict().items()},
        "seed": seed,
        "schedule": "warmup-constant",
        **opts.model_dump(exclude={"cache_dir"}),
        "data": hashlib.sha256(json.dumps(sequences).encode()).hexdigest(),
    }
    key = json.dumps(recipe, sort_keys=True)
    path = Path(opts.cache_dir) / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"
    if path.is_file():
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        return path
    _fit(model, sequences, opts, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save(model.state_dict(), tmp)
    os.replace(tmp, path)  # never a half-written cache entry
    return path


def _tokens(tokenizer: Tokenizer, example: dict[str, Any]) -> tuple[list[int], int]:
    """(prompt + reply + EOS tokens, prompt length) of one transcript ending in the reply."""
    messages = example.get("messages")
    if not messages or messages[-1].get("role") != "assistant":
        raise ValueError(
            "each warm-start example needs 'messages' ending with the assistant's reply, got "
            f"{str(example)[:120]}"
        )
    prompt = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True)
    reply = [*tokenizer.encode(str(messages[-1]["content"])), tokenizer.eos_token_id]
    return prompt + reply, len(prompt)


def _fit(
    model: Decoder, sequences: list[tuple[list[int], int]], opts: WarmStartOptions, seed: int
) -> None:
    """Token-mean cross-entropy on the replies, AdamW with a short warmup and a constant rate."""
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=opts.lr, weight_decay=0.0)
    # Linear warmup, then constant: a decay to zero would end the stage just as the model starts
    # to learn arithmetic, and RL continues from where it stops anyway.
    warmup = max(1, opts.steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup)
    )
    model.train()
    for _ in tqdm(range(opts.steps), desc="warm start", unit="step", leave=False, disable=None):
        batch = rng.sample(sequences, min(opts.batch_size, len(sequences)))
        width = max(len(tokens) for tokens, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width - 1)
        for i, (tokens, prompt_len) in enumerate(batch):
            ids[i, : len(tokens)] = torch.tensor(tokens)
            mask[i, prompt_len - 1 : len(tokens) - 1] = 1.0  # predict the reply and its EOS
        ids, mask = ids.to(device), mask.to(device)
        logits = model(ids[:, :-1]).float()
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
        )
        loss = (nll * mask.reshape(-1)).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
    model.eval()
