"""The `backend:` keys of `name: local`, and what start-up refuses before it builds anything."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from rllm_async.backends.local.hf import checkpoint_dir, model_config, read_config
from rllm_async.backends.local.lora import LoRAOptions
from rllm_async.backends.local.warm_start import WarmStartOptions
from rllm_async.config import Config, ConfigError
from rllm_async.engines.vllm.engine import VLLMOptions, eval_problem

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LocalOptions(BaseModel):
    """The `backend:` keys of `name: local`."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: Literal["tiny", "small"] = "tiny"  # a built-in preset, initialised from `seed`
    model_path: str | None = None  # a local Llama/Qwen-family checkpoint directory instead
    # Which code runs a `model_path` checkpoint: our decoder (`native`), transformers'
    # AutoModelForCausalLM (`transformers`: any architecture, slower), or `auto`: ours where it
    # implements the architecture, else transformers.
    model_impl: Literal["auto", "native", "transformers"] = "auto"
    device: str = "cpu"  # cpu, cuda, cuda:N, or auto
    # The sampler's weights and the trainer's autocast; trainer weights stay float32. `auto`:
    # bfloat16 where the device computes it natively (a GPU that supports it, a CPU with
    # AVX512-BF16 or AMX), else float32 (bfloat16 emulated on AVX2 is slower than float32).
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    max_batch: int = Field(default=32, ge=1)  # sequences decoded together
    train_batch: int = Field(default=16, ge=1)  # sequences per trainer forward/backward
    max_seq_len: int = Field(default=256, ge=2)  # prompt + completion
    # Where training runs: a thread of this process, or a process of its own, which on a CPU
    # spares it waiting for the interpreter lock that the sampler thread holds.
    learner: Literal["thread", "process"] = "thread"
    threads: int = Field(default=1, ge=1)  # torch threads of the learner
    sampler_threads: int = Field(default=1, ge=1)  # torch threads of the decode thread
    seed: int | None = None  # model init and unseeded sampling; None: the config's seed
    # AdamW's moments in a checkpoint: as trained (`float32`), rounded to `bfloat16` (half their
    # size; a resumed run's first updates differ by that rounding), or `none` (weights only; a
    # resumed run's moments start from zero).
    checkpoint_optimizer: Literal["float32", "bfloat16", "none"] = "float32"
    warm_start: WarmStartOptions | None = None  # supervised fine-tuning before RL, cached
    # Train low-rank adapters on the frozen model (after the warm start) instead of the model.
    lora: LoRAOptions | None = None
    # Who samples: the sampler thread of this process, or vLLM servers (`vllm:`), which reload
    # the learner's weights after every step; vllm needs a Hugging Face `model_path`.
    rollout: Literal["local", "vllm"] = "local"
    vllm: VLLMOptions = Field(default_factory=VLLMOptions)


def check_vllm(config: Config, opts: LocalOptions) -> None:
    """Refuse what `rollout: vllm` cannot do, naming what to use instead."""
    if opts.model_path is None:
        raise ConfigError(
            "backend.rollout: vllm serves a Hugging Face checkpoint: set backend.model_path to a "
            "Qwen/Llama-family checkpoint directory (`python -m rllm_async.models.tiny_qwen DIR` "
            "builds a tiny one), or use rollout: local"
        )
    co = config.coordinator
    if co.weight_update == "pin" and co.pipeline_depth != 0:
        raise ConfigError(
            "backend.rollout: vllm: a vLLM server holds one weight version, so an episode cannot "
            "stay on the version it started with (coordinator.weight_update: pin) while rollouts "
            f"overlap training (coordinator.pipeline_depth {co.pipeline_depth}): set "
            "coordinator.weight_update: latest (every token keeps the version that sampled it), "
            "or pipeline_depth: 0 (mode: sync)"
        )
    if co.weight_update == "pin" and config.train.mini_batches > 1:
        raise ConfigError(
            "backend.rollout: vllm: a vLLM server holds one weight version, so an episode cannot "
            "stay on the version it started with (coordinator.weight_update: pin) while "
            f"train.mini_batches ({config.train.mini_batches}) steps the optimizer before the "
            "batch's rollouts end: set coordinator.weight_update: latest, or mini_batches: 1"
        )
    if problem := eval_problem(config.eval.every_steps):
        raise ConfigError(problem)


def check_fallback(opts: LocalOptions) -> None:
    """Refuse what the transformers fallback does not do, naming what to do instead."""
    refused = {
        "lora": "backend.lora adapts our decoder's fused layers",
        "rollout": "backend.rollout: vllm syncs our decoder's weights into vLLM",
        "learner": "backend.learner: process shares our decoder's weights by their layout",
    }
    defaults = LocalOptions()
    for key, why in refused.items():
        if getattr(opts, key) != getattr(defaults, key):
            raise ConfigError(
                f"{why}; the transformers fallback (model_impl: transformers, or auto for an "
                f"architecture our decoder does not implement) does not support it: remove "
                f"backend.{key}, or use the verl backend, which trains transformers' own models"
            )


def model_impl(opts: LocalOptions) -> tuple[Literal["native", "transformers"], str]:
    """Which code runs the model, our decoder or transformers, and why (for the start-up log)."""
    if opts.model_path is None:
        if opts.model_impl == "transformers":
            raise ConfigError(
                "backend.model_impl: transformers needs a backend.model_path checkpoint; the "
                f"built-in preset '{opts.model}' is our decoder: remove model_impl"
            )
        return "native", f"built-in preset '{opts.model}'"
    if "model" in opts.model_fields_set:
        raise ValueError("give either backend.model (a preset) or backend.model_path, not both")
    path = checkpoint_dir(Path(opts.model_path).expanduser())
    raw = read_config(path)
    kind = raw.get("model_type")
    if opts.model_impl == "transformers":
        return "transformers", f"backend.model_impl: transformers ({kind})"
    try:
        model_config(raw, path)
    except ValueError as e:
        if opts.model_impl == "native":
            raise ConfigError(
                f"backend.model_impl: native, but our decoder cannot run it: {e}. Set "
                "backend.model_impl: auto (or transformers) to run it through transformers' "
                "AutoModelForCausalLM (slower), or use another checkpoint"
            ) from e
        return "transformers", f"our decoder does not implement it ({e})"
    return "native", f"model_type '{kind}' is one our decoder implements"


def device_of(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ConfigError(
            f"backend.device '{name}' is not a device: use cpu, cuda, cuda:N or auto"
        ) from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("backend.device is cuda but no GPU is visible to torch: use cpu or auto")
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(
            f"backend.device '{name}' is not supported: use cpu, cuda, cuda:N or auto"
        )
    return device


def dtype_of(name: str, device: torch.device) -> torch.dtype:
    """`backend.dtype` on `device`, `auto` resolved (see `native_bfloat16`)."""
    if name == "float16" and device.type == "cpu":
        raise ConfigError("backend.dtype float16 needs a GPU: use float32 or bfloat16 on cpu")
    if name == "auto":
        return torch.bfloat16 if native_bfloat16(device) else torch.float32
    return DTYPES[name]


def native_bfloat16(device: torch.device) -> bool:
    """Whether `device` multiplies bfloat16 matrices in hardware: a GPU that supports bfloat16, or
    a CPU with AVX512-BF16 or AMX tiles (torch's own probes, where this torch has them)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)
