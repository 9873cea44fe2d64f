"""`start_engine`: a VLLMEngine over a one-tensor Qwen3 checkpoint, as the unit tests start one
against scripted servers or interpreters."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rllm_async.backends.toy_tokenizers import CharTokenizer
from rllm_async.engines.vllm.engine import VLLMEngine, VLLMOptions


def start_engine(opts: VLLMOptions, tmp_path: Path) -> VLLMEngine:
    """Start (or attach to `opts.urls`) an engine of a checkpoint written under `tmp_path`, its
    run directory `tmp_path / "run"`."""
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    return VLLMEngine(
        opts,
        checkpoint=checkpoint,
        state={"model.embed_tokens.weight": torch.zeros(4, 2)},
        tokenizer=CharTokenizer(),
        max_seq_len=64,
        run_dir=tmp_path / "run",
        mode="keep",
    )
