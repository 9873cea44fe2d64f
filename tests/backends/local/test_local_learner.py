"""Recomputed old logprobs in the local learner: the ratio of every pass over a batch is taken
against the learner's own logprobs from before the batch's first optimizer step."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
import torch

from rllm_async.backends.local import LocalBackend
from rllm_async.config import Config, LossConfig
from rllm_async.types import TrajectoryGroup
from tests.backends.local.test_local_backend import make_config, params, sample_groups

SHIFT = 0.3  # how far the sampler's logprobs are moved off the trainer's, alternating in sign


def config(behaviour: str | None, *, mini_batches: int = 1, epochs: int = 1, **loss: Any) -> Config:
    """A small batch config; `behaviour` None leaves `behaviour_logprobs` at its default."""
    if behaviour is not None:
        loss["behaviour_logprobs"] = behaviour
    return make_config(
        algorithm={"loss": loss},
        optim={"lr": 0.05, "grad_clip": None},
        train={
            "total_steps": 4,
            "groups_per_step": 4,
            "micro_batch_groups": 1,
            "mini_batches": mini_batches,
            "epochs_per_batch": epochs,
        },
        coordinator={"max_staleness": None},
    )


async def mismatched_groups(backend: LocalBackend, n: int) -> list[TrajectoryGroup]:
    """Real rollouts whose recorded logprobs are moved +-SHIFT: a sampler that differs from the
    trainer by a known amount."""
    groups = await sample_groups(backend, n)
    for group in groups:
        for traj in group.trajectories:
            for step in traj.steps:
                step.logprobs = [lp + SHIFT * (-1) ** i for i, lp in enumerate(step.logprobs)]
    return groups


def reference_logprobs(backend: LocalBackend, groups: list[TrajectoryGroup]) -> list[list[float]]:
    """Each training sequence's sampled-token logprobs, one plain unpacked forward pass each."""
    out = []
    model = backend.learner.model
    with torch.no_grad():
        for g in groups:
            for seq, _ in g.training_sequences():
                logits = model(torch.tensor([seq.tokens]))[0, :-1].float()
                chosen = torch.log_softmax(logits, -1).gather(
                    -1, torch.tensor(seq.tokens[1:])[:, None]
                )
                out.append(
                    [
                        lp
                        for lp, m in zip(chosen[:, 0].tolist(), seq.loss_mask[1:], strict=True)
                        if m
                    ]
                )
    return out


def expected(
    groups: list[TrajectoryGroup], new: list[list[float]], old: list[list[float]], cfg: LossConfig
) -> dict[str, float]:
    """PPO-clip against `old` with the truncated old-over-sampler weight, by hand, per token."""
    sums = {"policy": 0.0, "clip_low": 0.0, "clip_high": 0.0, "kl": 0.0, "is_clipped": 0.0}
    tokens = 0
    seqs = [(seq, adv) for g in groups for seq, adv in g.training_sequences()]
    for (seq, adv), new_lp, old_lp in zip(seqs, new, old, strict=True):
        sampler = [lp for lp, m in zip(seq.logprobs, seq.loss_mask, strict=True) if m]
        for lp, o, s in zip(new_lp, old_lp, sampler, strict=True):
            r = math.exp(lp - o)
            weight = 1.0 if cfg.importance_sampling == "none" else min(math.exp(o - s), cfg.is_cap)
            clipped = min(max(r, 1 - cfg.clip_low), 1 + cfg.clip_high)
            sums["policy"] += -weight * min(r * adv, clipped * adv)
            sums["clip_low"] += r < 1 - cfg.clip_low and adv < 0
            sums["clip_high"] += r > 1 + cfg.clip_high and adv > 0
            sums["kl"] += math.exp(o - s) - (o - s) - 1
            sums["is_clipped"] += o - s > math.log(cfg.is_cap)
            tokens += 1
    return {k: v / tokens for k, v in sums.items()} | {"tokens": tokens}


def assert_matches(metrics: dict[str, float], want: dict[str, float]) -> None:
    one_token = 1.01 / want["tokens"]  # a token within float error of a clip bound may flip
    assert metrics["loss/num_tokens"] == want["tokens"]
    assert metrics["loss/policy"] == pytest.approx(want["policy"], abs=1e-4)
    assert metrics["loss/clip_frac_low"] == pytest.approx(want["clip_low"], abs=one_token)
    assert metrics["loss/clip_frac_high"] == pytest.approx(want["clip_high"], abs=one_token)
    assert metrics["loss/old_sampler_kl"] == pytest.approx(want["kl"], rel=1e-3)
    assert metrics["loss/is_frac_clipped"] == pytest.approx(want["is_clipped"], abs=one_token)


def test_the_first_pass_ratio_is_exactly_one_where_the_sampler_ratio_is_not() -> None:
    # Zero clip range: any ratio off 1 by a rounding error would count as clipped.
    loss = {"clip_low": 0.0, "clip_high": 0.0, "importance_sampling": "none"}

    async def first_pass(behaviour: str) -> dict[str, float]:
        cfg = config(behaviour, **loss)
        backend = LocalBackend.from_config(cfg)
        groups = await mismatched_groups(backend, 3)
        metrics = await backend.forward_backward(groups, cfg.algorithm.loss)
        await backend.close()
        return metrics

    async def main() -> None:
        recomputed, sampler = await first_pass("recomputed"), await first_pass("sampler")
        assert recomputed["loss/clip_frac_low"] == recomputed["loss/clip_frac_high"] == 0.0
        assert sampler["loss/clip_frac_low"] > 0.1 and sampler["loss/clip_frac_high"] > 0.1
        # The sampler stays what the mismatch metrics compare with.
        assert recomputed["loss/sampler_kl"] == pytest.approx(sampler["loss/sampler_kl"])
        k3 = (math.exp(SHIFT) - SHIFT - 1 + math.exp(-SHIFT) + SHIFT - 1) / 2
        assert recomputed["loss/old_sampler_kl"] == pytest.approx(k3, rel=0.2)
        assert "loss/old_sampler_kl" not in sampler

    asyncio.run(main())


LOSS = {"clip_low": 0.05, "clip_high": 0.05, "importance_sampling": "token_truncate", "is_cap": 1.2}


def test_a_second_pass_takes_the_ratio_against_the_recomputed_logprobs() -> None:
    cfg = config("recomputed", epochs=2, **LOSS)
    loss = cfg.algorithm.loss

    async def main() -> None:
        backend = LocalBackend.from_config(cfg)
        groups = await mismatched_groups(backend, 3)
        old = reference_logprobs(backend, groups)
        first = await backend.forward_backward(groups, loss)
        assert_matches(first, expected(groups, old, old, loss))
        await backend.optim_step()
        new = reference_logprobs(backend, groups)
        second = await backend.forward_backward(groups, loss)
        await backend.optim_step()
        want = expected(groups, new, old, loss)
        assert want["clip_low"] + want["clip_high"] > 0.05, "the step moved the policy"
        assert_matches(second, want)
        # Against the sampler the same pass clips otherwise.
        sampler = await backend.forward_backward(
            groups, loss.model_copy(update={"behaviour_logprobs": "sampler"})
        )
        assert sampler["loss/clip_frac_high"] != pytest.approx(second["loss/clip_frac_high"])
        await backend.close()

    asyncio.run(main())


def test_later_mini_batches_keep_the_logprobs_of_the_batch_start() -> None:
    cfg = config("recomputed", mini_batches=2, **LOSS)
    loss = cfg.algorithm.loss

    async def main() -> None:
        backend = LocalBackend.from_config(cfg)
        groups = await mismatched_groups(backend, 4)
        first, later = groups[:2], groups[2:]
        old = reference_logprobs(backend, later)
        await backend.forward_backward(first, loss)
        await backend.recompute_logprobs(later)
        await backend.optim_step()
        metrics = await backend.forward_backward(later, loss)
        assert_matches(metrics, expected(later, reference_logprobs(backend, later), old, loss))
        await backend.close()

    asyncio.run(main())


def test_old_logprobs_are_recorded_only_before_a_batchs_first_step() -> None:
    cfg = config("recomputed", epochs=2, **LOSS)
    loss = cfg.algorithm.loss

    async def main() -> None:
        backend = LocalBackend.from_config(cfg)
        groups = await mismatched_groups(backend, 2)
        await backend.forward_backward(groups[:1], loss)
        await backend.optim_step()
        with pytest.raises(RuntimeError, match="before a batch's first optimizer step"):
            await backend.recompute_logprobs(groups[1:])
        with pytest.raises(RuntimeError, match="no old logprobs in this batch"):
            await backend.forward_backward(groups[1:], loss)
        await backend.close()

    asyncio.run(main())


def test_the_default_takes_the_ratio_against_the_sampler() -> None:
    cfg = config(None, epochs=2, **{**LOSS, "importance_sampling": "none"})
    loss = cfg.algorithm.loss
    assert loss.behaviour_logprobs == "sampler"

    async def main() -> None:
        backend = LocalBackend.from_config(cfg)
        groups = await mismatched_groups(backend, 3)
        sampler = [
            [lp for lp, m in zip(seq.logprobs, seq.loss_mask, strict=True) if m]
            for g in groups
            for seq, _ in g.training_sequences()
        ]
        for _ in range(2):
            new = reference_logprobs(backend, groups)
            metrics = await backend.forward_backward(groups, loss)
            await backend.optim_step()
            want = expected(groups, new, sampler, loss)
            assert metrics["loss/policy"] == pytest.approx(want["policy"], abs=1e-4)
            assert metrics["loss/clip_frac_low"] == pytest.approx(want["clip_low"], abs=0.02)
            assert "loss/old_sampler_kl" not in metrics
        await backend.close()

    asyncio.run(main())


def test_a_resumed_learner_recomputes_the_next_batch_as_the_uninterrupted_one(tmp_path) -> None:
    cfg = config("recomputed", epochs=2, **LOSS)
    loss = cfg.algorithm.loss

    async def batch(backend: LocalBackend, groups: list[TrajectoryGroup]) -> list[dict]:
        out = []
        for _ in range(2):
            out.append(await backend.forward_backward(groups, loss))
            await backend.optim_step()
        return out

    async def main() -> None:
        first = LocalBackend.from_config(cfg)
        groups = await mismatched_groups(first, 2)
        await batch(first, groups[:1])
        await first.on_policy_updated(2)
        await first.save(tmp_path / "ckpt")  # checkpoints fall on batch ends
        expected = await batch(first, groups[1:])

        resumed = LocalBackend.from_config(cfg)
        await resumed.load(tmp_path / "ckpt")
        got = await batch(resumed, groups[1:])
        assert got[0]["loss/clip_frac_high"] == got[0]["loss/clip_frac_low"] == 0.0
        assert expected[1]["loss/clip_frac_high"] > 0, "the second pass is off the old policy"
        assert got[1]["loss/clip_frac_high"] == pytest.approx(expected[1]["loss/clip_frac_high"])
        assert got[1]["loss/policy"] == pytest.approx(expected[1]["loss/policy"], abs=1e-6)
        assert torch.allclose(params(resumed), params(first), atol=1e-6)
        for b in (first, resumed):
            await b.close()

    asyncio.run(main())
