"""A local-backend checkpoint as a Hugging Face model directory: safetensors, config.json, tokenizer
files with the chat template, generation_config.json. Loadable by `transformers` and vLLM."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from rllm_async.backends.local.hf import checkpoint_dir, load_chat_tokenizer, model_config
from rllm_async.backends.local.lora import LoRA, LoRAOptions
from rllm_async.backends.local.model import (
    ModelConfig,
    Transformer,
    hf_state_dict,
    preset_config,
)
from rllm_async.backends.toy_tokenizers import CharTokenizer, char_hf_tokenizer
from rllm_async.config import RolloutConfig
from rllm_async.engines.vllm.weights import write_weights

# Files of a source checkpoint that the export writes itself (weights and configs) or never needs.
_NOT_COPIED = ("config.json", "generation_config.json", "model.safetensors.index.json")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def export_model(
    state: dict[str, torch.Tensor],
    out: Path,
    *,
    preset: str,
    model_path: str | None,
    max_seq_len: int,
    rollout: RolloutConfig,
    lora: tuple[LoRAOptions, dict[str, torch.Tensor]] | None = None,
    base_changed: bool = False,
) -> None:
    """Write our decoder's `state` (its own names) and what loads it into the new directory `out`:
    the source checkpoint's config and tokenizer files for a `backend.model_path` model, a Llama
    config and the character tokenizer for a built-in `preset`.

    With `lora` (options, adapter state), `out` holds the merged model, `out/adapter` the PEFT
    adapter and, unless the base is the `model_path` checkpoint unchanged (no warm start:
    `base_changed` false), `out/base` the base model it applies to."""
    if model_path is None:
        cfg = preset_config(preset, CharTokenizer().vocab_size)
        raw, source = _llama_config(cfg, max_seq_len), None
    else:
        source = checkpoint_dir(Path(model_path).expanduser())
        raw = json.loads((source / "config.json").read_text())
        cfg = model_config(raw, source)
    model = Transformer(cfg)
    model.load_state_dict(state)
    adapters = None
    if lora is not None:
        adapters = LoRA(model, lora[0])
        adapters.load_state_dict(lora[1])
    raw[_dtype_key(raw)] = "float32"  # the learner's weights, written as they are
    merged = model if adapters is None else adapters.merged_copy(model)
    write_weights(hf_state_dict(merged), out, config=raw)
    if source is None:
        tokenizer = char_hf_tokenizer()
        tokenizer.save_pretrained(str(out))
        generation: dict[str, Any] = {
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        }
    else:
        _copy_tokenizer(source, out)
        generation = _source_generation(source, raw)
    _write_generation_config(generation, out, rollout)
    if adapters is not None:
        base = None if source is None or base_changed else str(source)
        if base is None:
            export_model(
                state,
                out / "base",
                preset=preset,
                model_path=model_path,
                max_seq_len=max_seq_len,
                rollout=rollout,
            )
        adapters.save_peft(out / "adapter", base)


def export_transformers_model(
    state: dict[str, torch.Tensor], out: Path, *, model_path: str, rollout: RolloutConfig
) -> None:
    """Write the transformers fallback's `state` (`TransformersModel` names: `hf.` and the Hugging
    Face name) into the new directory `out`, with the source checkpoint's config and tokenizer."""
    source = checkpoint_dir(Path(model_path).expanduser())
    raw = json.loads((source / "config.json").read_text())
    raw[_dtype_key(raw)] = "float32"
    write_weights({name.removeprefix("hf."): w for name, w in state.items()}, out, config=raw)
    _copy_tokenizer(source, out)
    _write_generation_config(_source_generation(source, raw), out, rollout)


def _source_generation(source: Path, raw: dict[str, Any]) -> dict[str, Any]:
    """The source checkpoint's generation config (if any), its `eos_token_id` the tokens our
    sampler stops at (a GGUF's checkpoint has no generation config, and without one a default
    `generate` runs past the end of the turn), its `pad_token_id` the model config's if unset."""
    gen_file = source / "generation_config.json"
    generation: dict[str, Any] = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
    _, stop_ids = load_chat_tokenizer(source)
    generation["eos_token_id"] = list(stop_ids) if len(stop_ids) > 1 else stop_ids[0]
    if generation.get("pad_token_id") is None and raw.get("pad_token_id") is not None:
        generation["pad_token_id"] = raw["pad_token_id"]
    return generation


def _write_generation_config(generation: dict[str, Any], out: Path, rollout: RolloutConfig) -> None:
    """`generation` plus the sampling the policy was trained with, so that a default `generate`
    reproduces it."""
    temperature = rollout.temperature
    generation.update(do_sample=temperature > 0, temperature=temperature, top_p=rollout.top_p)
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))


def _llama_config(cfg: ModelConfig, max_seq_len: int) -> dict[str, Any]:
    """A built-in preset's shape as a Hugging Face Llama config (same RoPE convention and norms)."""
    tokenizer = CharTokenizer()
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.hdim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "attention_bias": False,
        "mlp_bias": False,
        "max_position_embeddings": max_seq_len,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": 0,
    }


def _dtype_key(raw: dict[str, Any]) -> str:
    """`dtype` where the config already says so (transformers 5), else `torch_dtype`."""
    return "dtype" if "dtype" in raw else "torch_dtype"


def _copy_tokenizer(source: Path, out: Path) -> None:
    """Every file of `source` but weights and configs: tokenizer files, chat template, docs."""
    for path in source.iterdir():
        if path.is_file() and path.name not in _NOT_COPIED and path.suffix not in _WEIGHT_SUFFIXES:
            shutil.copy2(path, out / path.name)
