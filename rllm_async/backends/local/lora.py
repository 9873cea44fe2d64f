"""LoRA adapters on the local decoder's linear layers (`backend.lora`).

The adapters live in a module of their own beside the frozen base model and add their term to the
targeted layers' outputs through forward hooks, so the base model's parameters, names and state
dict stay as they were. A fused layer (`qkv_proj`, `gate_up_proj`) gets one adapter per Hugging
Face layer it fuses (`q_proj`, `k_proj`, `v_proj`; `gate_proj`, `up_proj`), as PEFT would give the
unfused model. Sampling and export merge the adapters into a copy of the weights: the base is
never changed, so there is nothing to unmerge.
"""

from __future__ import annotations

import json
import math
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import nn

from rllm_async.backends.local.model import Block, Transformer, frozen_copy

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PEFT_PREFIX = "base_model.model.model."  # PEFT's name for our `layers.*` modules


class LoRAOptions(BaseModel):
    """`backend.lora`: low-rank adapters trained instead of the whole model."""

    model_config = ConfigDict(extra="forbid")

    rank: int = Field(default=8, ge=1)
    alpha: float = Field(default=16.0, gt=0.0)  # the adapters' output is scaled by alpha / rank
    target_modules: list[str] = Field(default_factory=lambda: list(TARGETS))
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)  # on the adapters' input, in training

    @field_validator("target_modules")
    @classmethod
    def _known(cls, names: list[str]) -> list[str]:
        unknown = sorted(set(names) - set(TARGETS))
        if unknown or not names:
            raise ValueError(
                f"unknown LoRA target modules {unknown}: choose among {', '.join(TARGETS)}"
                if unknown
                else "give at least one LoRA target module"
            )
        return names

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


# (start row, stop row, adapter index or None) of each Hugging Face layer a linear layer holds.
_Parts = list[tuple[int, int, int | None]]


class LoRA(nn.Module):
    """The adapters of `model`'s targeted layers, hooked into its forward pass; freezes `model`.

    B starts at zero, so the adapted model starts as the base model; A is initialised as
    `nn.Linear` (and PEFT) do, from `seed`.
    """

    def __init__(self, model: Transformer, opts: LoRAOptions, seed: int = 0) -> None:
        super().__init__()
        self.opts = opts
        self.names: list[str] = []  # Hugging Face module name (no `model.` prefix) per adapter
        self.A = nn.ParameterList()  # [rank, in] each
        self.B = nn.ParameterList()  # [out, rank] each
        self.dropout = nn.Dropout(opts.dropout) if opts.dropout > 0 else nn.Identity()
        self._parts: dict[str, _Parts] = {}  # our module name -> its parts
        gen = torch.Generator().manual_seed(seed)
        device = next(model.parameters()).device
        model.requires_grad_(False)
        for name, linear, parts in _linears(model):
            prefix = name.rsplit(".", 1)[0]
            layout: _Parts = []
            start = 0
            for hf_name, rows in parts:
                index = None
                if hf_name in opts.target_modules:
                    index = len(self.names)
                    self.names.append(f"{prefix}.{hf_name}")
                    a = torch.empty(opts.rank, linear.in_features)
                    nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)
                    self.A.append(nn.Parameter(a.to(device)))
                    self.B.append(nn.Parameter(torch.zeros(rows, opts.rank, device=device)))
                layout.append((start, start + rows, index))
                start += rows
            if any(index is not None for *_, index in layout):
                self._parts[name] = layout
                linear.register_forward_hook(partial(self._hook, layout))

    def _hook(
        self, parts: _Parts, module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor
    ) -> torch.Tensor:
        """The layer's output plus scale * B A x on each adapted part."""
        pieces = []
        for start, stop, index in parts:
            piece = out[..., start:stop]
            if index is not None:
                low = F.linear(self.dropout(args[0]), self.A[index])
                piece = piece + self.opts.scale * F.linear(low, self.B[index])
            pieces.append(piece)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)

    def merged_copy(self, model: Transformer) -> Transformer:
        """A frozen float32 copy of `model` (the base this was built on) with the adapters merged
        into its weights: W + scale * B A."""
        merged = frozen_copy(model, next(model.parameters()).device, torch.float32)
        modules = dict(merged.named_modules())
        with torch.no_grad():
            for name, parts in self._parts.items():
                weight = modules[name].weight
                for start, stop, index in parts:
                    if index is not None:
                        delta = self.B[index].float() @ self.A[index].float()
                        weight[start:stop] += self.opts.scale * delta
        return merged

    def save_peft(self, out: Path, base_model: str | None) -> None:
        """Write the adapters as a PEFT LoRA adapter: `adapter_model.safetensors` and
        `adapter_config.json`, for the Hugging Face export of the base model."""
        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for name, a, b in zip(self.names, self.A, self.B, strict=True):
            tensors[f"{_PEFT_PREFIX}{name}.lora_A.weight"] = a.detach().float().cpu().contiguous()
            tensors[f"{_PEFT_PREFIX}{name}.lora_B.weight"] = b.detach().float().cpu().contiguous()
        save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
        config: dict[str, Any] = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model,
            "r": self.opts.rank,
            "lora_alpha": self.opts.alpha,
            "lora_dropout": self.opts.dropout,
            "target_modules": sorted({n.rsplit(".", 1)[1] for n in self.names}),
            "bias": "none",
            "fan_in_fan_out": False,
            "use_rslora": False,
            "inference_mode": True,
        }
        (out / "adapter_config.json").write_text(json.dumps(config, indent=2))


def _linears(model: Transformer) -> list[tuple[str, nn.Linear, list[tuple[str, int]]]]:
    """Each linear layer of the blocks: its module name, the layer, and the Hugging Face layers it
    holds with their numbers of output rows, in order."""
    cfg = model.cfg
    q, kv = cfg.n_heads * cfg.hdim, cfg.kv_heads * cfg.hdim
    out = []
    for i, block in enumerate(model.layers):
        assert isinstance(block, Block)
        attn, mlp = block.self_attn, block.mlp
        out += [
            (f"layers.{i}.self_attn.qkv_proj", attn.qkv_proj, [("q_proj", q), ("k_proj", kv), ("v_proj", kv)]),
            (f"layers.{i}.self_attn.o_proj", attn.o_proj, [("o_proj", cfg.dim)]),
            (f"layers.{i}.mlp.gate_up_proj", mlp.gate_up_proj, [("gate_proj", cfg.ffn_dim), ("up_proj", cfg.ffn_dim)]),
            (f"layers.{i}.mlp.down_proj", mlp.down_proj, [("down_proj", cfg.dim)]),
        ]  # fmt: skip
    return out
