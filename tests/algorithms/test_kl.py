"""The KL penalty to the reference under off-policy samples: plain k3 and the importance-weighted
(bias-corrected) k3, against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from rllm_async.algorithms.losses import policy_loss
from rllm_async.config import LossConfig


def kl_loss(
    trainer: float, sampler: float, ref: float, corrected: bool
) -> tuple[float, float, dict[str, float]]:
    """One token with zero advantage: the loss (the KL penalty alone), its gradient, the metrics."""
    cfg = LossConfig(importance_sampling="none", kl_coef=1.0, kl_bias_correction=corrected)
    lp = torch.tensor([[trainer]], requires_grad=True)
    out = policy_loss(
        lp,
        torch.tensor([[sampler]]),
        torch.zeros(1, 1),
        torch.ones(1, 1),
        cfg,
        torch.tensor([[ref]]),
    )
    out.loss_sum.backward()
    assert lp.grad is not None
    return out.loss_sum.item(), float(lp.grad), out.stats.metrics()


def test_equal_to_plain_k3_when_sampler_and_trainer_coincide() -> None:
    lp, ref = math.log(0.4), math.log(0.2)
    k3 = 0.5 - math.log(0.5) - 1
    plain, plain_grad, m = kl_loss(lp, lp, ref, corrected=False)
    weighted, weighted_grad, _ = kl_loss(lp, lp, ref, corrected=True)
    assert plain == pytest.approx(k3, abs=1e-6) and weighted == pytest.approx(k3, abs=1e-6)
    # The ratio keeps its gradient (as in DeepSeek-V3.2 and TRL), so even on-policy the corrected
    # penalty's gradient adds k3 to plain k3's 1 - q: it is the gradient of KL(trainer || ref).
    assert plain_grad == pytest.approx(0.5, abs=1e-6)
    assert weighted_grad == pytest.approx(k3 + 0.5, abs=1e-6)
    assert m["loss/kl_ref"] == pytest.approx(m["loss/kl_ref_corrected"], abs=1e-6)


def test_weighted_by_the_trainer_to_sampler_ratio_when_they_differ() -> None:
    # Trainer twice as likely as the sampler; the reference half as likely as the trainer.
    sampler = math.log(0.2)
    lp, ref = sampler + math.log(2.0), sampler
    q = 0.5  # ref / trainer
    k3 = q - math.log(q) - 1
    plain, plain_grad, m = kl_loss(lp, sampler, ref, corrected=False)
    weighted, weighted_grad, m_weighted = kl_loss(lp, sampler, ref, corrected=True)
    assert plain == pytest.approx(k3, abs=1e-6)
    assert weighted == pytest.approx(2.0 * k3, abs=1e-6)
    # d/dlp of k3 is 1 - q; of r * k3 (r = trainer / sampler, with its gradient) r * (k3 + 1 - q).
    assert plain_grad == pytest.approx(1 - q, abs=1e-6)
    assert weighted_grad == pytest.approx(2.0 * (k3 + 1 - q), abs=1e-6)
    # Both estimators are reported whichever one the loss uses.
    for metrics in (m, m_weighted):
        assert metrics["loss/kl_ref"] == pytest.approx(k3, abs=1e-6)
        assert metrics["loss/kl_ref_corrected"] == pytest.approx(2.0 * k3, abs=1e-6)


def test_the_weighted_estimator_is_unbiased_over_sampler_samples() -> None:
    # Over a three-token vocabulary, the sampler-weighted expectation of the corrected estimator
    # is KL(trainer || ref) exactly; that of plain k3 is not.
    sampler, trainer, ref = [0.7, 0.2, 0.1], [0.2, 0.3, 0.5], [0.6, 0.3, 0.1]
    true_kl = sum(p * math.log(p / r) for p, r in zip(trainer, ref, strict=True))

    def expectation(corrected: bool) -> float:
        return sum(
            s * kl_loss(math.log(p), math.log(s), math.log(r), corrected)[0]
            for s, p, r in zip(sampler, trainer, ref, strict=True)
        )

    assert expectation(True) == pytest.approx(true_kl, abs=1e-6)
    assert expectation(False) == pytest.approx(0.7119152, abs=1e-6)  # plain k3: biased
