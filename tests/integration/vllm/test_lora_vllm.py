"""`backend.lora` with `rollout: vllm`: the server serves the adapters merged into the weights."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from rllm_async.backends.local import LocalBackend
from rllm_async.backends.local.model import frozen_copy
from rllm_async.config import config_from_dict
from rllm_async.protocols import SamplingParams
from rllm_async.types import Step, Trajectory, TrajectoryGroup


def test_a_sync_serves_the_merged_adapters(tiny_qwen: Path, tmp_path: Path) -> None:
    config = config_from_dict(
        {
            "run_dir": str(tmp_path / "runs"),
            "backend": {
                "name": "local",
                "model_path": str(tiny_qwen),
                "max_seq_len": 256,
                "rollout": "vllm",
                "vllm": {"dtype": "float32", "weights_dir": str(tmp_path / "weights")},
                "lora": {"rank": 4, "alpha": 8},
            },
            "mode": "sync",
            "rollout": {"max_tokens": 16},
            "optim": {"lr": 0.05},
        }
    )

    async def go() -> None:
        backend = LocalBackend.from_config(config)
        try:
            policy = backend.policy()
            prompt = policy.tokenizer.apply_chat_template([{"role": "user", "content": "2+2?"}])
            outs = [
                await policy.generate(prompt, SamplingParams(max_tokens=12, seed=i))
                for i in range(4)
            ]
            trajs = [Trajectory(steps=[Step(prompt, o.ids, o.logprobs, o.versions)]) for o in outs]
            group = TrajectoryGroup("t", "default", trajs, [1.0, -1.0, 0.5, -0.5])
            await backend.forward_backward([group], config.algorithm.loss)
            await backend.optim_step()
            await backend.on_policy_updated(1)
            out = await policy.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12))
            assert out.versions == [1] * len(out.ids)
            merged = backend.learner.merged_model()  # type: ignore[union-attr]
            with torch.no_grad():
                logits = merged(torch.tensor([[*prompt, *out.ids]]))[0, len(prompt) - 1 : -1]
                ours = torch.log_softmax(logits.float(), -1)
                ours = ours.gather(-1, torch.tensor(out.ids).unsqueeze(-1)).squeeze(-1)
                # The learner's model is the frozen base (its hooks add the adapters).
                base = frozen_copy(backend.learner.model, torch.device("cpu"), torch.float32)  # type: ignore[union-attr]
                plain = base(torch.tensor([[*prompt, *out.ids]]))[0, len(prompt) - 1 : -1]
                assert not torch.allclose(plain, logits, atol=1e-3)
            assert (torch.tensor(out.logprobs) - ours).abs().max() < 1e-3
        finally:
            await backend.close()

    asyncio.run(go())
