"""Policy losses against values computed by hand on tiny tensors."""

from __future__ import annotations

import math

import pytest
import torch

from rllm_async.algorithms.losses import policy_loss
from rllm_async.config import LossConfig

Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _inputs(
    ratios: list[list[float]], adv: list[list[float]], mask: list[list[float]] | None = None
) -> Inputs:
    """Trainer logprobs (with grad) such that exp(logprob - sampler_logprob) = ratios."""
    sampler = torch.full((len(ratios), len(ratios[0])), -1.0)
    logprobs = (sampler + torch.tensor(ratios).log()).requires_grad_(True)
    m = torch.ones_like(sampler) if mask is None else torch.tensor(mask)
    return logprobs, sampler, torch.tensor(adv), m


def test_ppo_clip_values_gradients_and_clip_fractions() -> None:
    cfg = LossConfig(name="ppo_clip", clip_low=0.2, clip_high=0.28, importance_sampling="none")
    # token: r<0.8 with A<0 (low clip) | on-policy | r>1.28 with A>0 (high clip) | r=1.1, A<0 | masked
    lp, slp, adv, mask = _inputs(
        [[0.5, 1.0, 1.5, 1.1, 3.0]], [[-1.0, 1.0, 1.0, -1.0, 1.0]], [[1, 1, 1, 1, 0]]
    )
    out = policy_loss(lp, slp, adv, mask, cfg)
    assert out.loss_sum.item() == pytest.approx(0.8 - 1.0 - 1.28 + 1.1, abs=1e-6)
    out.loss_sum.backward()
    assert lp.grad is not None
    # d/dlogp of -r*A is -r*A where unclipped; zero where the clip is active or masked.
    assert lp.grad.tolist()[0] == pytest.approx([0.0, -1.0, 0.0, 1.1, 0.0], abs=1e-6)
    m = out.stats.metrics()
    assert m["loss/num_tokens"] == 4
    assert m["loss/clip_frac_low"] == pytest.approx(0.25)
    assert m["loss/clip_frac_high"] == pytest.approx(0.25)
    assert m["loss/policy"] == pytest.approx((0.8 - 1.0 - 1.28 + 1.1) / 4, abs=1e-6)
    k3 = [r - 1 - math.log(r) for r in (0.5, 1.0, 1.5, 1.1)]
    assert m["loss/sampler_kl"] == pytest.approx(sum(k3) / 4, abs=1e-6)


def test_ppo_token_truncate_bounds_negative_advantage_tokens() -> None:
    cfg = LossConfig(name="ppo_clip", importance_sampling="token_truncate", is_cap=2.0)
    lp, slp, adv, mask = _inputs([[4.0, 1.0]], [[-1.0, -1.0]])
    out = policy_loss(lp, slp, adv, mask, cfg)
    # PPO alone would give 4*1 for the first token; the truncated weight is capped at 2.
    assert out.loss_sum.item() == pytest.approx(2.0 + 1.0, abs=1e-6)
    out.loss_sum.backward()
    assert lp.grad is not None
    assert lp.grad.tolist()[0] == pytest.approx([2.0, 1.0], abs=1e-6)
    assert out.stats.metrics()["loss/is_frac_clipped"] == pytest.approx(0.5)


def test_truncated_importance_sampling_values_and_weight_stats() -> None:
    cfg = LossConfig(name="importance_sampling", importance_sampling="token_truncate", is_cap=2.0)
    lp, slp, adv, mask = _inputs([[0.5, 1.0, 3.0]], [[1.0, -1.0, 1.0]])
    out = policy_loss(lp, slp, adv, mask, cfg)
    # -min(r, C)/r * r * A per token: -0.5, +1.0, -2.0.
    assert out.loss_sum.item() == pytest.approx(-1.5, abs=1e-6)
    out.loss_sum.backward()
    assert lp.grad is not None
    assert lp.grad.tolist()[0] == pytest.approx([-0.5, 1.0, -2.0], abs=1e-6)
    m = out.stats.metrics()
    assert m["loss/is_weight_mean"] == pytest.approx((0.5 + 1.0 + 2.0) / 3, abs=1e-6)
    assert m["loss/is_weight_min"] == pytest.approx(0.5, abs=1e-6)
    assert m["loss/is_weight_max"] == pytest.approx(2.0, abs=1e-6)
    assert m["loss/is_frac_clipped"] == pytest.approx(1 / 3)
    assert m["loss/clip_frac_low"] == m["loss/clip_frac_high"] == 0.0


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("none", -0.5 + 1.0 - 3.0),
        ("token_mask", -0.5 + 1.0),
        ("token_truncate", -0.5 + 1.0 - 2.0),
    ],
)
def test_token_level_modes(mode: str, expected: float) -> None:
    cfg = LossConfig(name="importance_sampling", importance_sampling=mode, is_cap=2.0)  # type: ignore[arg-type]
    out = policy_loss(*_inputs([[0.5, 1.0, 3.0]], [[1.0, -1.0, 1.0]]), cfg)
    assert out.loss_sum.item() == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        # Sequence ratios: 2*2 = 4 (over the cap of 2) and 1*0.5 = 0.5.
        ("sequence_truncate", -(2.0 + 2.0) * 2 / 4 - (1.0 + 0.5)),
        ("sequence_mask", -(1.0 + 0.5)),
    ],
)
def test_sequence_level_modes(mode: str, expected: float) -> None:
    cfg = LossConfig(name="importance_sampling", importance_sampling=mode, is_cap=2.0)  # type: ignore[arg-type]
    out = policy_loss(*_inputs([[2.0, 2.0], [1.0, 0.5]], [[1.0, 1.0], [1.0, 1.0]]), cfg)
    assert out.loss_sum.item() == pytest.approx(expected, abs=1e-6)
    assert out.stats.metrics()["loss/is_frac_clipped"] == pytest.approx(0.5)


def test_opsm_drops_only_negative_advantage_sequences_far_from_the_sampler() -> None:
    cfg = LossConfig(name="importance_sampling", importance_sampling="none", opsm_kl_threshold=0.1)
    far, near = math.exp(-0.5), math.exp(-0.05)
    lp, slp, adv, mask = _inputs(
        [[far, far], [far, far], [near, near]], [[-1.0, -1.0], [1.0, 1.0], [-1.0, -1.0]]
    )
    out = policy_loss(lp, slp, adv, mask, cfg)
    assert out.loss_sum.item() == pytest.approx(-2 * far + 2 * near, abs=1e-6)
    assert out.stats.metrics()["loss/opsm_frac"] == pytest.approx(1 / 3)


def test_cispo_clips_a_detached_weight() -> None:
    cfg = LossConfig(name="cispo", clip_low=0.2, clip_high=0.28, importance_sampling="none")
    lp, slp, adv, mask = _inputs([[0.5, 1.5]], [[1.0, 1.0]])
    out = policy_loss(lp, slp, adv, mask, cfg)
    out.loss_sum.backward()
    assert lp.grad is not None
    assert lp.grad.tolist()[0] == pytest.approx([-0.8, -1.28], abs=1e-6)
    m = out.stats.metrics()
    assert m["loss/clip_frac_low"] == m["loss/clip_frac_high"] == pytest.approx(0.5)


def test_kl_penalty_to_reference() -> None:
    cfg = LossConfig(name="ppo_clip", importance_sampling="none", kl_coef=0.1)
    lp, slp, _, mask = _inputs([[1.0]], [[0.0]])
    ref = lp.detach() + math.log(0.5)
    out = policy_loss(lp, slp, torch.zeros(1, 1), mask, cfg, ref_logprobs=ref)
    k3 = 0.5 - math.log(0.5) - 1
    assert out.loss_sum.item() == pytest.approx(0.1 * k3, abs=1e-6)
    assert out.stats.metrics()["loss/kl_ref"] == pytest.approx(k3, abs=1e-6)


@pytest.mark.parametrize(
    ("mode", "weights"),
    [("none", [1.0, 1.0]), ("token_truncate", [1.5, 0.5]), ("token_mask", [0.0, 0.5])],
)
def test_recomputed_old_logprobs_take_the_ratio_and_move_the_correction(
    mode: str, weights: list[float]
) -> None:
    cfg = LossConfig(
        name="ppo_clip", clip_low=0.2, clip_high=0.2, importance_sampling=mode, is_cap=1.5
    )
    # Trainer / old ratios 1.5 (clipped at 1.2) and 0.9; old / sampler ratios 3.0 and 0.5.
    sampler = torch.tensor([[-1.0, -1.0]])
    old = sampler + torch.tensor([[3.0, 0.5]]).log()
    logprobs = (old + torch.tensor([[1.5, 0.9]]).log()).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0]])
    out = policy_loss(logprobs, sampler, adv, torch.ones(1, 2), cfg, old_logprobs=old)
    assert out.loss_sum.item() == pytest.approx(-(weights[0] * 1.2 + weights[1] * 0.9), abs=1e-6)
    out.loss_sum.backward()
    assert logprobs.grad is not None
    # The clipped token gives no gradient; the other one -weight * ratio * A.
    assert logprobs.grad.tolist()[0] == pytest.approx([0.0, -weights[1] * 0.9], abs=1e-6)
    m = out.stats.metrics()
    assert m["loss/clip_frac_high"] == pytest.approx(0.5)
    k3 = [r - 1 - math.log(r) for r in (3.0, 0.5)]
    assert m["loss/old_sampler_kl"] == pytest.approx(sum(k3) / 2, abs=1e-6)
    # The sampler stays what the mismatch is measured against: trainer / sampler = 4.5 and 0.45.
    k3 = [r - 1 - math.log(r) for r in (4.5, 0.45)]
    assert m["loss/sampler_kl"] == pytest.approx(sum(k3) / 2, abs=1e-5)


def test_recomputed_old_logprobs_keep_the_sampler_ratio_for_the_kl_correction() -> None:
    cfg = LossConfig(importance_sampling="none", kl_coef=1.0, kl_bias_correction=True)
    sampler = torch.tensor([[-1.0]])
    old = sampler + math.log(2.0)
    logprobs = old.clone().requires_grad_(True)  # trainer = old, trainer / sampler = 2
    ref = logprobs.detach() - 0.5
    out = policy_loss(logprobs, sampler, torch.zeros(1, 1), torch.ones(1, 1), cfg, ref, old)
    k3 = math.exp(-0.5) + 0.5 - 1
    assert out.stats.metrics()["loss/kl_ref"] == pytest.approx(k3, abs=1e-6)
    # Weighted by trainer / sampler (2), not by trainer / old (1).
    assert out.stats.metrics()["loss/kl_ref_corrected"] == pytest.approx(2.0 * k3, abs=1e-6)
