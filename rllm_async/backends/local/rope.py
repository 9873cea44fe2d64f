"""Rotary frequencies: plain, or scaled as transformers computes its `rope_type`s llama3, linear
and yarn (`modeling_rope_utils`), so that a checkpoint's logits are the ones it was trained with."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

RopeKind = Literal["llama3", "linear", "yarn"]


@dataclass(frozen=True)
class RopeScaling:
    """A checkpoint's RoPE scaling, its defaults resolved as transformers resolves them."""

    kind: RopeKind
    factor: float
    original_max_positions: int  # the pretraining context (llama3, yarn)
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn: the ramp between extrapolated and interpolated frequencies
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn: round the ramp's ends to whole dimensions
    attention_factor: float = 1.0  # yarn: the scale of cos and sin


def inv_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None, device: torch.device
) -> torch.Tensor:
    """The [head_dim / 2] inverse frequencies of the rotary embedding."""
    exponents = torch.arange(0, head_dim, 2, device=device).float() / head_dim
    if scaling is None:
        return theta**-exponents
    inv_freq = 1.0 / theta**exponents
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "llama3":
        return _llama3(inv_freq, scaling)
    return _yarn(inv_freq, head_dim, theta, scaling)


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1's: long wavelengths divided by `factor`, short ones kept, a smooth ramp between."""
    low_freq_wavelen = s.original_max_positions / s.low_freq_factor
    high_freq_wavelen = s.original_max_positions / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_positions / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(inv_freq: torch.Tensor, dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    """YaRN's: interpolated (divided by `factor`) below a ramp of dimensions, kept above it."""

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(s.original_max_positions / (rotations * 2 * math.pi))) / (
            2 * math.log(theta)
        )

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers does, against a zero-width ramp
    ramp = (torch.arange(dim // 2, device=inv_freq.device).float() - low) / (high - low)
    extrapolated = 1 - ramp.clamp(0, 1)
    return inv_freq / s.factor * (1 - extrapolated) + inv_freq * extrapolated


def yarn_attention_factor(
    factor: float, mscale: float | None = None, mscale_all_dim: float | None = None
) -> float:
    """YaRN's default scale of cos and sin, from `factor` (and DeepSeek's `mscale`s)."""

    def get(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return get(factor, mscale) / get(factor, mscale_all_dim)
    return get(factor)
