"""Local Hugging Face checkpoints of the Llama family, loaded into our own decoder.

Only local files are read, a checkpoint directory or a Hub id's snapshot in the local Hugging Face
cache (never a download). `transformers` is imported lazily, for the tokenizer and its chat
template; the weights go into `model.Transformer`, so sampling and training use the same code as
the built-in presets.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rllm_async.backends.hf_tokenizer import HFTokenizer, load_tokenizer
from rllm_async.backends.local.model import ModelConfig
from rllm_async.backends.local.rope import RopeScaling, yarn_attention_factor

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


@dataclass
class Checkpoint:
    """What a checkpoint directory holds, in our terms."""

    config: ModelConfig
    state: dict[str, torch.Tensor]
    tokenizer: HFTokenizer
    stop_ids: tuple[int, ...]
    max_positions: int
    sliding_window: int | None


def load_checkpoint(path: Path) -> Checkpoint:
    """Read config, weights and tokenizer of a local checkpoint; refuse what we cannot run.

    `path` is a checkpoint directory, a Hub id cached locally, or a `.gguf` file (dequantized once
    into a cache directory).
    """
    path = checkpoint_dir(path)
    raw = read_config(path)
    config = model_config(raw, path)
    tokenizer, stop_ids = load_chat_tokenizer(path)
    window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
    max_positions = int(raw.get("max_position_embeddings", 2048))
    if config.rope_scaling is not None and config.rope_scaling.kind == "yarn":
        scaling = config.rope_scaling  # max_position_embeddings may be the unscaled context
        max_positions = max(max_positions, int(scaling.factor * scaling.original_max_positions))
    return Checkpoint(
        config=config,
        state=_load_weights(path),
        tokenizer=tokenizer,
        stop_ids=stop_ids,
        max_positions=max_positions,
        sliding_window=window,
    )


def read_config(path: Path) -> dict[str, Any]:
    """The config.json of a checkpoint directory."""
    if not (path / "config.json").is_file():
        raise ValueError(
            f"backend.model_path {path} has no config.json: give a checkpoint directory"
        )
    raw: dict[str, Any] = json.loads((path / "config.json").read_text())
    return raw


def load_chat_tokenizer(path: Path) -> tuple[HFTokenizer, tuple[int, ...]]:
    """A checkpoint's tokenizer (which must have a chat template) and the token ids that end a
    completion: its EOS and those of `generation_config.json`."""
    tokenizer = load_tokenizer(path, setting="backend.model_path", require_chat_template=True)
    stop_ids = {tokenizer.eos_token_id}
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        eos = json.loads(gen_file.read_text()).get("eos_token_id")
        stop_ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return tokenizer, tuple(sorted(stop_ids))


def model_config(raw: dict[str, Any], path: Path) -> ModelConfig:
    """Our decoder's shape for a checkpoint's config.json; refuses what the decoder cannot run."""
    kind = raw.get("model_type")
    if kind not in SUPPORTED:
        raise ValueError(
            f"{path}: model_type '{kind}' is not supported by the local backend "
            f"(supported: {', '.join(SUPPORTED)})"
        )
    rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    for key in ("attention_bias", "mlp_bias"):
        if kind == "llama" and raw.get(key):
            raise ValueError(f"{path}: llama with {key}=true is not supported by the local backend")
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{path}: hidden_act '{raw['hidden_act']}' is not supported (need silu)")
    return ModelConfig(
        vocab_size=raw["vocab_size"],
        dim=raw["hidden_size"],
        n_layers=raw["num_hidden_layers"],
        n_heads=raw["num_attention_heads"],
        n_kv_heads=raw.get("num_key_value_heads"),
        head_dim=raw.get("head_dim"),
        ffn_dim=raw["intermediate_size"],
        rope_theta=float(raw.get("rope_theta", rope.get("rope_theta", 10000.0))),
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        qkv_bias=kind == "qwen2",
        qk_norm=kind == "qwen3",
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        rope_scaling=rope_scaling(raw, path),
    )


def rope_scaling(raw: dict[str, Any], path: Path) -> RopeScaling | None:
    """A config.json's RoPE scaling, its defaults as transformers fills them; None: plain RoPE.

    `dynamic` (NTK) runs as plain RoPE: transformers stretches its base only for sequences longer
    than `max_position_embeddings`, which `backend.max_seq_len` may not exceed.
    """
    rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(
            f"{path}: rope_type '{kind}' is not supported by the local backend "
            f"(supported: {', '.join(ROPE_TYPES)})"
        )
    if rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(
            f"{path}: partial rotary embeddings are not supported by the local backend"
        )
    if kind in ("default", "dynamic"):
        return None
    max_positions = int(raw.get("max_position_embeddings", 2048))
    original = int(
        raw.get("original_max_position_embeddings")
        or rope.get("original_max_position_embeddings")
        or max_positions
    )
    factor = rope.get("factor")
    if kind == "yarn":
        factor = float(factor or max_positions / original)
        attention = rope.get("attention_factor")
        if attention is None:
            attention = yarn_attention_factor(
                factor, rope.get("mscale"), rope.get("mscale_all_dim")
            )
        return RopeScaling(
            "yarn",
            factor,
            original,
            beta_fast=float(rope.get("beta_fast") or 32.0),
            beta_slow=float(rope.get("beta_slow") or 1.0),
            truncate=bool(rope.get("truncate", True)),
            attention_factor=float(attention),
        )
    if factor is None:
        raise ValueError(f"{path}: rope scaling {rope} has no factor")
    if kind == "linear":
        return RopeScaling("linear", float(factor), original)
    return RopeScaling(
        "llama3",
        float(factor),
        original,
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
    )


def _load_weights(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint, renamed to our module names."""
    files = sorted(path.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        raw: dict[str, torch.Tensor] = {}
        for file in files:
            raw.update(load_file(str(file)))
    elif (path / "pytorch_model.bin").is_file():
        raw = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"{path} has no *.safetensors or pytorch_model.bin weights")
    return {
        k.removeprefix("model."): v for k, v in raw.items() if not k.endswith("rotary_emb.inv_freq")
    }


def checkpoint_dir(path: Path) -> Path:
    """The checkpoint directory of `backend.model_path`: itself, a `.gguf` file's dequantized
    copy (made once, in a cache directory), or a Hub id's snapshot in the local Hugging Face cache."""
    if path.suffix == ".gguf":
        return gguf_to_checkpoint(path)
    if not path.exists() and HUB_ID.fullmatch(str(path)):
        return hub_snapshot(str(path))
    return path


def hub_snapshot(repo_id: str) -> Path:
    """The newest snapshot of a Hub model in the local Hugging Face cache; never downloads."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except LocalEntryNotFoundError as e:
        raise ValueError(
            f"backend.model_path {repo_id}: no such directory, and no snapshot of the Hugging Face "
            f"Hub model {repo_id} in the local cache ({constants.HF_HUB_CACHE}); nothing is "
            f"downloaded at run time: fetch it first with `hf download {repo_id}` "
            f"(`huggingface-cli download {repo_id}` with older huggingface_hub), or give a "
            "checkpoint directory"
        ) from e


def gguf_to_checkpoint(file: Path, cache_root: Path | None = None) -> Path:
    """Dequantize a local GGUF file into a checkpoint directory (config, safetensors, tokenizer).

    Done once per file: the directory is keyed by the file's name, size and mtime, under
    `$RLLM_ASYNC_CACHE` (default `~/.cache/rllm-async`). Needs `transformers`, `gguf` and
    `accelerate`; nothing is downloaded.
    """
    if not file.is_file():
        raise ValueError(f"backend.model_path {file} does not exist")
    stat = file.stat()
    key = hashlib.sha256(f"{file.name}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    root = (
        cache_root or Path(os.environ.get("RLLM_ASYNC_CACHE", "~/.cache/rllm-async")).expanduser()
    )
    out = root / "gguf" / f"{file.stem}-{key}"
    if (out / "config.json").is_file():
        return out
    try:
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise ImportError(
            "a .gguf backend.model_path needs transformers, gguf and accelerate: "
            "pip install transformers gguf accelerate"
        ) from e
    where = {"gguf_file": file.name, "local_files_only": True}
    tokenizer = AutoTokenizer.from_pretrained(str(file.parent), **where)
    model = AutoModelForCausalLM.from_pretrained(str(file.parent), **where)
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    # Tied weights share storage, which safetensors refuses: store independent copies.
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(tmp / "model.safetensors"))
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config))
    tokenizer.save_pretrained(str(tmp))
    os.replace(tmp, out)
    return out
