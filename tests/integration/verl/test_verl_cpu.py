"""The verl backend end to end on the CPU: two verl FSDP workers in a Ray group, a tiny random Llama."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from rllm_async import UnifiedTrainer
from rllm_async.backends import get_backend_factory
from rllm_async.config import Config, config_from_dict
from rllm_async.protocols import SamplingParams
from rllm_async.types import Step, Trajectory, TrajectoryGroup

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


@pytest.fixture(scope="module", autouse=True)
def local_ray() -> Iterator[None]:
    """One Ray for the module (the backend reuses a running Ray and leaves it running)."""
    ray.init(num_cpus=4, include_dashboard=False)
    yield
    ray.shutdown()


def make_config(checkpoint: Path, run_dir: Path, **sections: Any) -> Config:
    return config_from_dict(
        {
            "name": "verl-cpu",
            "run_dir": str(run_dir),
            "backend": {
                "name": "verl",
                "model_path": str(checkpoint),
                "device": "cpu",
                "gpus_per_node": 2,
                "max_seq_len": 64,
                "max_batch": 16,
            },
            "workflow": {"args": {"reward_fn": "rewards:has_digit"}},
            "data": {
                "train": {
                    "generator": "rllm_async.tasks.countdown:generator",
                    "args": {"n": 64, "seed": 2},
                }
            },
            "rollout": {"group_size": 4, "max_tokens": 8, "timeout_s": 120},
            "train": {"total_steps": 3, "groups_per_step": 4, "micro_batch_groups": 2},
            "optim": {"lr": 0.01, "warmup_steps": 2},
            "eval": {"at_end": False},
            "checkpoint": {"at_end": False, "resume": "never"},
            "logging": {"progress_bar": False},
            **sections,
        }
    )


async def sample_groups(backend: Any, n: int, temperature: float) -> list[TrajectoryGroup]:
    """Groups of real rollouts from the backend's sampler, with rewards that differ in each group."""
    policy = backend.policy()
    groups = []
    for g in range(n):
        prompt = policy.tokenizer.apply_chat_template([{"role": "user", "content": "ab" * (g + 1)}])
        outs = [
            await policy.generate(
                prompt, SamplingParams(temperature, max_tokens=3 + 4 * g, seed=10 * g + i)
            )
            for i in range(4)
        ]
        trajs = [
            Trajectory([Step(prompt, o.ids, o.logprobs, o.versions)], reward=float(i % 2))
            for i, o in enumerate(outs)
        ]
        groups.append(TrajectoryGroup(f"t{g}", "default", trajs, [r - 0.5 for r in (0, 1, 0, 1)]))
    return groups


def weights(backend: Any, version: int) -> torch.Tensor:
    return torch.cat([p.flatten() for p in backend.rollout.store.get(version)[1].parameters()])


def test_streamed_step_equals_whole_step(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """Two micro-batches then a step give the update of one batch then a step, and the trainer's
    logprobs equal the sampler's on the same weights (packing, temperature and export agree)."""
    cfg = make_config(tiny_checkpoint, tmp_path, rollout={"temperature": 0.8, "max_tokens": 16})
    loss = cfg.algorithm.loss

    async def main() -> None:
        backend = get_backend_factory("verl").from_config(cfg)
        try:
            groups = await sample_groups(backend, 3, cfg.rollout.temperature)
            before = weights(backend, 0)
            await backend.save(tmp_path / "start")
            await backend.forward_backward(groups[:1], loss)
            await backend.forward_backward(groups[1:], loss)
            streamed = await backend.optim_step()
            await backend.on_policy_updated(1)
            after_streamed = weights(backend, 1)

            await backend.load(tmp_path / "start")
            assert torch.equal(weights(backend, 0), before)
            await backend.forward_backward(groups, loss)
            whole = await backend.optim_step()
            await backend.on_policy_updated(1)
            after_whole = weights(backend, 1)
        finally:
            await backend.close()
        assert streamed["loss/sampler_kl"] < 1e-6, streamed
        assert streamed["loss/is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
        assert streamed["optim/num_tokens"] == sum(g.num_completion_tokens for g in groups)
        assert streamed["optim/lr"] == whole["optim/lr"] == pytest.approx(0.005)
        assert streamed["optim/grad_norm"] == pytest.approx(whole["optim/grad_norm"], rel=1e-5)
        assert not torch.allclose(after_streamed, before)
        torch.testing.assert_close(after_streamed, after_whole, atol=1e-5, rtol=0)

    asyncio.run(main())


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_trainer_runs_on_verl(tiny_checkpoint: Path, tmp_path: Path, mode: str) -> None:
    cfg = make_config(tiny_checkpoint, tmp_path, mode=mode)
    records = UnifiedTrainer(cfg).run()
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["optim/num_tokens"] > 0 and r["loss/num_tokens"] > 0 for r in records)
    assert any(r["optim/grad_norm"] > 0 for r in records)
    assert max(r["staleness/max"] for r in records) == (0 if mode == "sync" else 1)
