"""Policy-gradient losses (backend-agnostic torch): PPO-clip, importance sampling and CISPO.

Bypass mode: the sampler's recorded logprobs are the old logprobs, so the ratio
`r = exp(logprob - sampler_logprob)` measures staleness and sampler/trainer mismatch together, and
no extra forward pass with old weights is needed. On top of the loss, `importance_sampling` bounds
that ratio with a detached factor `k` per token (truncate: the effective weight never exceeds
`is_cap`; mask: a token or sequence whose ratio exceeds `is_cap` is dropped), and OPSM drops
negative-advantage sequences that drifted too far from the sampler.

Recomputed old logprobs (`behaviour_logprobs: recomputed`, decoupled PPO as in verl): the ratio and
its clipping are taken against the trainer's own logprobs from before the batch's first optimizer
step, and `importance_sampling` turns into the detached correction from the sampler to that old
policy: each token's loss is multiplied by the old-over-sampler weight (truncated at `is_cap`, or
masked above it; `none` leaves it out). OPSM, `sampler_kl` and the KL bias correction still compare
the trainer with the sampler, whose samples the tokens are.

Every function returns *sums* over loss tokens: the caller divides by the optimizer step's total
token count, so splitting a step into micro-batches does not change the gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from rllm_async.config import LossConfig

# Statistics reported as token means.
_MEAN_KEYS = (
    "policy",
    "clip_frac_low",
    "clip_frac_high",
    "sampler_kl",
    "kl_ref",
    "kl_ref_corrected",
    "old_sampler_kl",
)
# exp() of a sequence's summed log-ratio overflows quickly; stats are clamped to this log range.
_MAX_LOG = 30.0


@dataclass
class LossStats:
    """Additive statistics of one or more batches; `metrics()` turns them into `loss/*` means."""

    tokens: float = 0.0
    sequences: float = 0.0
    sums: dict[str, float] = field(default_factory=dict)
    weight_min: float = math.inf
    weight_max: float = -math.inf

    def add(self, key: str, value: float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + value

    def merge(self, other: LossStats) -> None:
        """Fold another batch's statistics into these."""
        self.tokens += other.tokens
        self.sequences += other.sequences
        for key, value in other.sums.items():
            self.add(key, value)
        self.weight_min = min(self.weight_min, other.weight_min)
        self.weight_max = max(self.weight_max, other.weight_max)

    def metrics(self) -> dict[str, float]:
        """Token means (sequence means for `opsm_frac`), extremes and counts, as floats."""
        out = {"loss/num_tokens": self.tokens, "loss/num_sequences": self.sequences}
        if self.tokens > 0:
            for key in _MEAN_KEYS:
                if key in self.sums:
                    out[f"loss/{key}"] = self.sums[key] / self.tokens
            out["loss/is_weight_mean"] = self.sums["is_weight"] / self.tokens
            out["loss/is_frac_clipped"] = self.sums["is_clipped"] / self.tokens
            out["loss/is_weight_min"] = self.weight_min
            out["loss/is_weight_max"] = self.weight_max
        if self.sequences > 0 and "opsm_masked" in self.sums:
            out["loss/opsm_frac"] = self.sums["opsm_masked"] / self.sequences
        return out


@dataclass
class LossOutput:
    """The summed loss of a batch (differentiable) and its statistics."""

    loss_sum: torch.Tensor
    stats: LossStats


def importance_factor(
    log_ratio: torch.Tensor, mask: torch.Tensor, cfg: LossConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Detached factor `k` multiplying each token's loss, the effective IS weight, and which
    tokens the correction touched. All [S, T]; `log_ratio` is zero outside `mask`.
    """
    mode = cfg.importance_sampling
    lr = log_ratio.detach()
    if mode.startswith("sequence"):
        lr = (lr * mask).sum(-1, keepdim=True).expand_as(lr)
    lr = lr.clamp(-_MAX_LOG, _MAX_LOG)
    log_cap = math.log(cfg.is_cap)
    over = lr > log_cap
    if mode == "none":
        factor = torch.ones_like(lr)
        over = torch.zeros_like(over)
    elif mode.endswith("truncate"):
        factor = torch.exp((log_cap - lr).clamp(max=0.0))
    else:
        factor = (~over).to(lr.dtype)
    weight = torch.exp(lr) * factor
    return factor, weight, over & (mask > 0)


def policy_loss(
    logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
    ref_logprobs: torch.Tensor | None = None,
    old_logprobs: torch.Tensor | None = None,
) -> LossOutput:
    """The summed loss over loss tokens of a padded batch of sequences.

    All inputs are [S, T] aligned per token: the trainer's logprobs of the sampled tokens (with
    grad), the sampler's logprobs, per-token advantages, a 0/1 loss mask, and optionally a frozen
    reference model's logprobs for the `kl_coef` penalty. With `old_logprobs` (the trainer's own,
    recomputed before the batch's first optimizer step) the ratio is taken against those.
    """
    mask = mask.to(logprobs.dtype)
    log_ratio = (logprobs - sampler_logprobs) * mask
    ratio = torch.exp(log_ratio)
    if old_logprobs is None:
        pg_ratio = ratio
        factor, weight, clipped = importance_factor(log_ratio, mask, cfg)
    else:
        pg_ratio = torch.exp((logprobs - old_logprobs) * mask)
        old_log_ratio = (old_logprobs - sampler_logprobs) * mask
        factor, weight, clipped = importance_factor(old_log_ratio, mask, cfg)
        if cfg.importance_sampling != "none":
            factor = weight  # the ratio leaves old/sampler out: the weight itself corrects
    lo, hi = 1.0 - cfg.clip_low, 1.0 + cfg.clip_high
    if cfg.name == "ppo_clip":
        pg = -torch.minimum(pg_ratio * advantages, pg_ratio.clamp(lo, hi) * advantages)
        clip_low = (pg_ratio < lo) & (advantages < 0)
        clip_high = (pg_ratio > hi) & (advantages > 0)
    elif cfg.name == "cispo":
        pg = -pg_ratio.clamp(lo, hi).detach() * logprobs * advantages
        clip_low, clip_high = pg_ratio < lo, pg_ratio > hi
    else:  # importance_sampling
        pg = -pg_ratio * advantages
        clip_low = clip_high = torch.zeros_like(mask, dtype=torch.bool)

    stats = LossStats()
    seq_tokens = mask.sum(-1)
    has_tokens = seq_tokens > 0
    if cfg.opsm_kl_threshold is not None:
        # Mean of log(sampler / trainer) over the sequence: a KL(sampler || trainer) estimate.
        seq_kl = -log_ratio.detach().sum(-1) / seq_tokens.clamp(min=1)
        seq_adv = (advantages * mask).sum(-1) / seq_tokens.clamp(min=1)
        dropped = (seq_adv < 0) & (seq_kl > cfg.opsm_kl_threshold) & has_tokens
        factor = factor * (~dropped).to(factor.dtype).unsqueeze(-1)
        stats.add("opsm_masked", float(dropped.sum()))

    per_token = factor * pg
    stats.add("policy", float((per_token.detach() * mask).sum()))
    if ref_logprobs is not None and cfg.kl_coef > 0:
        kl_ref = _k3(ref_logprobs - logprobs)
        # k3 estimates KL(trainer || ref) from trainer samples; the tokens come from the sampler,
        # so weighting by the ratio trainer/sampler removes the bias. The ratio keeps its gradient
        # (DeepSeek-V3.2, TRL's use_bias_correction_kl): the gradient of KL(trainer || ref).
        kl_corrected = ratio * kl_ref
        per_token = per_token + cfg.kl_coef * (kl_corrected if cfg.kl_bias_correction else kl_ref)
        stats.add("kl_ref", float((kl_ref.detach() * mask).sum()))
        stats.add("kl_ref_corrected", float((kl_corrected.detach() * mask).sum()))

    on = mask > 0
    stats.tokens = float(mask.sum())
    stats.sequences = float(has_tokens.sum())
    stats.add("clip_frac_low", float((clip_low & on).sum()))
    stats.add("clip_frac_high", float((clip_high & on).sum()))
    stats.add("sampler_kl", float((_k3(log_ratio.detach()) * mask).sum()))
    if old_logprobs is not None:
        stats.add("old_sampler_kl", float((_k3(old_log_ratio.detach()) * mask).sum()))
    stats.add("is_weight", float((weight * mask).sum()))
    stats.add("is_clipped", float(clipped.sum()))
    if bool(on.any()):
        stats.weight_min = float(weight[on].min())
        stats.weight_max = float(weight[on].max())
    return LossOutput(loss_sum=(per_token * mask).sum(), stats=stats)


def _k3(log_q_over_p: torch.Tensor) -> torch.Tensor:
    """Schulman's non-negative estimator of KL(p || q) from samples of p, given log(q/p)."""
    return torch.exp(log_q_over_p) - log_q_over_p - 1.0
