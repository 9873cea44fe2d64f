"""A Llama-style decoder in plain PyTorch: RoPE (optionally scaled), RMSNorm, SwiGLU, optional GQA
and tied embeddings.

Module names follow the Hugging Face Llama/Qwen layout, except that the q/k/v projections are one
`qkv_proj` and the gate/up projections one `gate_up_proj`: one matmul each instead of three and
two, which is most of what a small model's decode step costs. `hf_weights` names every weight as
Hugging Face does (the fused ones as slices), so checkpoints of that family load and export by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from rllm_async.backends.local.rope import RopeScaling, inv_frequencies


class AttentionView(Protocol):
    """Where the tokens of a forward pass sit and what they attend to: the sampler's KV-cache
    slots (`cache.CacheView`) or the trainer's packed rows (`packing.PackedBatch`)."""

    @property
    def positions(self) -> torch.Tensor: ...  # [B, T] rotary positions

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor: ...  # [B, H, T, D] queries, [B, KV, T, D] keys/values -> [B, H, T, D]


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    ffn_dim: int
    n_kv_heads: int | None = None  # None: same as n_heads (no GQA)
    head_dim: int | None = None  # None: dim // n_heads
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = True
    rope_scaling: RopeScaling | None = None

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def hdim(self) -> int:
        return self.head_dim or self.dim // self.n_heads


PRESETS: dict[str, tuple[int, int, int, int]] = {  # dim, n_layers, n_heads, ffn_dim
    "tiny": (64, 2, 4, 176),  # ~0.1M parameters
    "small": (128, 5, 4, 352),  # ~1M parameters
}


def preset_config(name: str, vocab_size: int) -> ModelConfig:
    """The config of a built-in preset for a given vocabulary."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset '{name}': choose one of {', '.join(PRESETS)}")
    dim, n_layers, n_heads, ffn_dim = PRESETS[name]
    return ModelConfig(vocab_size, dim=dim, n_layers=n_layers, n_heads=n_heads, ffn_dim=ffn_dim)


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 for stability in low precision."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply rotary embeddings in the split-halves convention; x is [B, T, H, D]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """SDPA of [B, H, T, D] queries over [B, KV, S, D] keys/values (grouped-query heads repeated),
    under `mask` [B, 1, T, S] (boolean, or added to the scores), or causal when there is none."""
    n_heads = q.shape[1]
    if k.shape[1] != n_heads:
        k = k.repeat_interleave(n_heads // k.shape[1], dim=1)
        v = v.repeat_interleave(n_heads // v.shape[1], dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)


class Attention(nn.Module):
    """Causal self-attention, or attention as an `AttentionView` lays it out when given one."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv, self.hdim = cfg.n_heads, cfg.kv_heads, cfg.hdim
        self.qkv_proj = nn.Linear(
            cfg.dim, (cfg.n_heads + 2 * cfg.kv_heads) * cfg.hdim, bias=cfg.qkv_bias
        )
        self.o_proj = nn.Linear(cfg.n_heads * cfg.hdim, cfg.dim, bias=False)
        self.q_norm = RMSNorm(cfg.hdim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.hdim, cfg.norm_eps) if cfg.qk_norm else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, view: AttentionView | None
    ) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.qkv_proj(x).view(b, t, self.n_heads + 2 * self.n_kv, self.hdim)
        qk, v = qkv.split((self.n_heads + self.n_kv, self.n_kv), dim=2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split((self.n_heads, self.n_kv), dim=2)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=2)
        q, k = rotate(qk, cos, sin).transpose(1, 2).split((self.n_heads, self.n_kv), dim=1)
        v = v.transpose(1, 2)
        y = attention(q, k, v) if view is None else view.attend(self.layer, q, k, v)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.dim, 2 * cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, view: AttentionView | None
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, view)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """The decoder: token ids [B, T] -> next-token logits [B, T, vocab]."""

    shares_prompts: ClassVar[bool] = True  # the learner may pack a group's prompt once per row

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def vocab_size(self) -> int:
        """The width of the logits."""
        return self.cfg.vocab_size

    def forward(self, tokens: torch.Tensor, view: AttentionView | None = None) -> torch.Tensor:
        """Logits for every position; with `view`, tokens sit at `view.positions`."""
        return self.lm_head(self.hidden(tokens, view))

    def hidden(self, tokens: torch.Tensor, view: AttentionView | None = None) -> torch.Tensor:
        """Final normed hidden states [B, T, dim], for callers that need logits at a few positions."""
        if view is not None:
            positions = view.positions
        else:
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        x = self.embed_tokens(tokens)
        scaling = self.cfg.rope_scaling
        inv_freq = inv_frequencies(self.cfg.hdim, self.cfg.rope_theta, scaling, x.device)
        freqs = positions.unsqueeze(-1).float() * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1).unsqueeze(2)  # [B, T, 1, head_dim]
        cos, sin = angles.cos(), angles.sin()
        if scaling is not None and scaling.attention_factor != 1.0:
            cos, sin = cos * scaling.attention_factor, sin * scaling.attention_factor
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for block in self.layers:
            x = block(x, cos, sin, view)
        return self.norm(x)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def hf_weights(model: Transformer) -> dict[str, torch.Tensor]:
    """Every distinct weight of `model` under its Hugging Face Llama/Qwen name (without the
    `model.` prefix), the fused projections' parts as views into them."""
    cfg = model.cfg
    q, kv = cfg.n_heads * cfg.hdim, cfg.kv_heads * cfg.hdim
    weights: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():  # a tied lm_head is listed once, as embed_tokens
        if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
            prefix, kind = name.rsplit(".qkv_proj.", 1)
            for part, piece in zip("qkv", p.split((q, kv, kv)), strict=True):
                weights[f"{prefix}.{part}_proj.{kind}"] = piece
        elif name.endswith("gate_up_proj.weight"):
            prefix = name.removesuffix(".gate_up_proj.weight")
            gate, up = p.chunk(2)
            weights[f"{prefix}.gate_proj.weight"], weights[f"{prefix}.up_proj.weight"] = gate, up
        else:
            weights[name] = p
    return weights


def hf_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """`model`'s weights under the names of a Hugging Face checkpoint file (`model.` prefixed)."""
    return {
        name if name == "lm_head.weight" else f"model.{name}": tensor
        for name, tensor in hf_weights(model).items()
    }


def build_model(cfg: ModelConfig, seed: int) -> Transformer:
    """A freshly initialised model; the same config and seed always give the same weights."""
    model = Transformer(cfg)
    gen = torch.Generator().manual_seed(seed)
    std = 0.02
    with torch.no_grad():
        for name, p in sorted(hf_weights(model).items()):
            if name.endswith("norm.weight"):
                continue
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                # Residual-branch outputs start small so the depth does not blow up the stream.
                nn.init.normal_(p, std=std / (2 * cfg.n_layers) ** 0.5, generator=gen)
            else:
                nn.init.normal_(p, std=std, generator=gen)
    return model


def load_model(
    cfg: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype
) -> Transformer:
    """A model holding copies of Hugging Face-named `weights` (see `hf_weights`), in `dtype` on
    `device`. A tied model takes its output layer from `embed_tokens.weight`."""
    with torch.device("meta"):
        model = Transformer(cfg).to(dtype)  # free on the meta device; then one allocation
    model = model.to_empty(device=device)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    targets = hf_weights(model)
    given = set(weights) - ({"lm_head.weight"} if cfg.tie_embeddings else set())
    if given != set(targets):
        missing, unexpected = sorted(set(targets) - given), sorted(given - set(targets))
        raise ValueError(
            f"weights do not fit the model {cfg}: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}; is the checkpoint a Llama/Qwen-family decoder?"
        )
    with torch.no_grad():
        for name, target in targets.items():
            if weights[name].shape != target.shape:
                raise ValueError(
                    f"weight {name} has shape {tuple(weights[name].shape)}, the model "
                    f"{cfg} expects {tuple(target.shape)}"
                )
            target.copy_(weights[name])
    return model


def frozen_copy(model: Transformer, device: torch.device, dtype: torch.dtype) -> Transformer:
    """An inference-only copy of `model`'s weights (a sampler snapshot, a reference model)."""
    return load_model(model.cfg, hf_weights(model), device, dtype).eval().requires_grad_(False)
