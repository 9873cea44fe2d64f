"""Our advantages and losses against verl's `core_algos` on the same inputs.

These pin down what the verl backend's loss (ours, run inside verl's engine) means in verl's terms:
`ppo_clip` is verl's `vanilla` loss without dual-clip, `cispo` is verl's `cispo`, and our GRPO
without std normalization is verl's GRPO with `norm_adv_by_std_in_grpo=False` (Dr. GRPO).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from verl.trainer.ppo import core_algos
from verl.workers.config import FSDPActorConfig

from rllm_async.algorithms.advantages import grpo
from rllm_async.algorithms.losses import policy_loss
from rllm_async.backends.verl import batch
from rllm_async.backends.verl.loss import LOSS_KEY, summed_policy_loss
from rllm_async.config import LossConfig

REWARDS = [[1.0, 0.0, 0.0, 1.0], [0.2, 0.2, 0.9], [3.0, -1.0]]


def verl_grpo(normalize: bool) -> list[float]:
    scores = [r for group in REWARDS for r in group]
    index = np.array([i for i, group in enumerate(REWARDS) for _ in group])
    rewards = torch.tensor(scores).unsqueeze(-1)
    adv, _ = core_algos.compute_grpo_outcome_advantage(
        rewards, torch.ones_like(rewards), index, norm_adv_by_std_in_grpo=normalize
    )
    return adv.squeeze(-1).tolist()


def test_grpo_equals_verls_without_std_normalization() -> None:
    ours = [a for group in REWARDS for a in grpo(group, False)]
    assert ours == pytest.approx(verl_grpo(normalize=False), abs=1e-6)


def test_grpo_std_normalization_differs_from_verls_by_bessels_correction() -> None:
    """We divide by the population std, verl by the sample std (n - 1)."""
    ours = [a * math.sqrt((len(g) - 1) / len(g)) for g in REWARDS for a in grpo(g, True)]
    assert ours == pytest.approx(verl_grpo(normalize=True), abs=1e-4)


def inputs(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Logprobs (with grad), sampler logprobs far enough off to clip, advantages of both signs, a mask."""
    g = torch.Generator().manual_seed(seed)
    shape = (6, 9)
    logprobs = (-torch.rand(shape, generator=g) * 3).requires_grad_(True)
    sampler = logprobs.detach() + torch.randn(shape, generator=g) * 0.5
    advantages = torch.randn(shape[0], 1, generator=g).expand(shape).contiguous()
    mask = (torch.rand(shape, generator=g) > 0.2).float()
    return logprobs, sampler, advantages * mask, mask


def verl_actor(loss_mode: str) -> FSDPActorConfig:
    return FSDPActorConfig(
        strategy="fsdp2",
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=1e9,  # verl's dual-clip off: our ppo_clip has none
        ppo_micro_batch_size_per_gpu=1,
        ppo_mini_batch_size=1,
        rollout_n=1,
        policy_loss={"loss_mode": loss_mode},
    )


@pytest.mark.parametrize(("ours", "theirs"), [("ppo_clip", "vanilla"), ("cispo", "cispo")])
def test_policy_loss_equals_verls(ours: str, theirs: str) -> None:
    cfg = LossConfig(name=ours, clip_low=0.2, clip_high=0.28, importance_sampling="none")
    logprobs, sampler, advantages, mask = inputs()
    mine = policy_loss(logprobs, sampler, advantages, mask, cfg).loss_sum
    (grad_mine,) = torch.autograd.grad(mine, logprobs)
    fn = core_algos.get_policy_loss_fn(theirs)
    verl_loss, _ = fn(
        old_log_prob=sampler,
        log_prob=logprobs,
        advantages=advantages,
        response_mask=mask.bool(),
        loss_agg_mode="token-sum",
        config=verl_actor(theirs),
    )
    (grad_verl,) = torch.autograd.grad(verl_loss, logprobs)
    torch.testing.assert_close(mine, verl_loss)
    torch.testing.assert_close(grad_mine, grad_verl)


def test_worker_loss_is_the_summed_policy_loss_times_dp_size() -> None:
    """What runs inside verl's engine: our loss on verl's jagged model output, summed."""
    cfg = LossConfig()
    logprobs, sampler, advantages, mask = inputs(seed=1)
    rows = [
        batch.Row(
            [1, 2],
            list(range(9)),
            mask[i].int().tolist(),
            sampler[i].tolist(),
            float(advantages[i][mask[i] > 0][0]) if mask[i].any() else 0.0,
        )
        for i in range(len(mask))
    ]
    td = batch.to_tensordict(
        rows, temperature=1.0, extra={LOSS_KEY: cfg.model_dump(), "dp_size": 2}
    )
    full = torch.cat([torch.cat([torch.zeros(1), lp, torch.zeros(1)]) for lp in logprobs.detach()])
    lengths = torch.tensor([0] + [11] * len(rows)).cumsum(0)
    model_output = {"log_probs": torch.nested.nested_tensor_from_jagged(full, lengths)}
    loss, _ = summed_policy_loss(model_output, td)
    expected = policy_loss(logprobs.detach(), sampler, advantages, mask, cfg).loss_sum * 2
    torch.testing.assert_close(loss, expected)
