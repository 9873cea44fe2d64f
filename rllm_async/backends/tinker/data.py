"""Training examples from trajectory groups, the step's loss normalization, and loss metrics.

Tinker's losses are computed on the server, one request per micro-batch, and the step's totals are
unknown when its first micro-batch is sent. So the per-token weight (folded into the advantages,
since the RL losses take no weights) is fixed per step from an estimate of the step's total loss
tokens: every micro-batch of a step gets the same factor, so the step's gradient has exactly the
direction of the token-mean loss, and only its magnitude is off by actual/estimated tokens
(reported as `tinker/grad_scale_error`; Adam is nearly invariant to such a constant factor, except
through grad_clip). The estimate is the previous step's tokens per group (the first micro-batch's
on the first step) times `groups_per_step`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from rllm_async.algorithms.losses import LossStats, policy_loss
from rllm_async.config import LossConfig
from rllm_async.types import TrajectoryGroup

Reduction = Literal["sum", "sequence_mean"]


@dataclass(slots=True)
class Example:
    """One datum: inputs, next-token targets and, per target, sampler logprob, mask, weight."""

    inputs: list[int]
    targets: list[int]
    logprobs: list[float]
    mask: list[int]
    advantage: float
    weight: float = 1.0  # the normalization factor folded into the advantages sent

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.mask)

    def sent_advantages(self) -> list[float]:
        """The per-token advantages the server sees: weighted on loss tokens, 0 elsewhere."""
        a = self.advantage * self.weight
        return [a if m else 0.0 for m in self.mask]


def examples(groups: list[TrajectoryGroup]) -> list[Example]:
    """One example per token sequence with at least one loss token; prompt and tool tokens get 0."""
    out = []
    for group in groups:
        for traj, advantage in zip(group.trajectories, group.advantages, strict=True):
            for seq in traj.sequences():
                if sum(seq.loss_mask[1:]) == 0:
                    continue
                out.append(
                    Example(
                        inputs=seq.tokens[:-1],
                        targets=seq.tokens[1:],
                        logprobs=[
                            lp if m else 0.0
                            for lp, m in zip(seq.logprobs[1:], seq.loss_mask[1:], strict=True)
                        ],
                        mask=seq.loss_mask[1:],
                        advantage=float(advantage),
                    )
                )
    return out


@dataclass(slots=True)
class StepNormalizer:
    """Fixes each step's per-token weight from the expected step size; measures the error."""

    groups_per_step: int
    reduction: Reduction
    per_group: tuple[float, float] | None = None  # (loss tokens, examples) per group, last step
    expected: tuple[float, float] | None = None  # (loss tokens, examples) of the open step
    tokens: int = 0
    count: int = 0
    groups: int = 0

    def weigh(self, groups: list[TrajectoryGroup], batch: list[Example]) -> None:
        """Set `weight` on this micro-batch's examples (opening the step on its first one)."""
        tokens = sum(e.num_loss_tokens for e in batch)
        if self.expected is None:
            per_group = self.per_group or (tokens / len(groups), len(batch) / len(groups))
            self.expected = (
                per_group[0] * self.groups_per_step,
                per_group[1] * self.groups_per_step,
            )
        exp_tokens, exp_count = self.expected
        for e in batch:
            e.weight = 1.0 / exp_tokens
            if self.reduction == "sequence_mean":
                e.weight *= len(e.targets) * exp_count
        self.tokens += tokens
        self.count += len(batch)
        self.groups += len(groups)

    def close_step(self) -> dict[str, float]:
        """End the step: report actual/intended gradient magnitude and update the estimate."""
        metrics: dict[str, float] = {}
        if self.expected is not None and self.tokens > 0:
            exp_tokens, exp_count = self.expected
            error = self.tokens / exp_tokens
            if self.reduction == "sequence_mean":
                error *= exp_count / self.count
            metrics["tinker/grad_scale_error"] = error
            self.per_group = (self.tokens / self.groups, self.count / self.groups)
        self.expected, self.tokens, self.count, self.groups = None, 0, 0, 0
        return metrics


def loss_stats(batch: list[Example], learner: list[list[float]], loss: LossConfig) -> LossStats:
    """The shared loss statistics (`loss/*`) of a batch, from the learner logprobs the server returns."""
    width = max(len(e.targets) for e in batch)

    def pad(rows: list[list[float]]) -> torch.Tensor:
        return torch.tensor([r + [0.0] * (width - len(r)) for r in rows], dtype=torch.float64)

    mask = pad([[float(m) for m in e.mask] for e in batch])
    with torch.no_grad():
        return policy_loss(
            logprobs=pad(learner) * mask,
            sampler_logprobs=pad([e.logprobs for e in batch]),
            advantages=pad([[e.advantage] * len(e.targets) for e in batch]),
            mask=mask,
            cfg=loss,
        ).stats
