"""The learning-rate schedule, shared by every backend that takes the rate per optimizer step."""

from __future__ import annotations

import math

from rllm_async.config import OptimConfig


def learning_rate(cfg: OptimConfig, step: int, total_steps: int) -> float:
    """The rate of optimizer step `step` (0-based): linear warmup, then constant/linear/cosine."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    if cfg.schedule == "linear":
        return cfg.lr * (1.0 - progress)
    return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * progress))
