"""`backend.rollout: vllm` refuses at start-up what one vLLM server cannot honour, naming the fix."""

from __future__ import annotations

from typing import Any

import pytest

from rllm_async.backends.local import LocalBackend
from rllm_async.config import ConfigError, load_config


def vllm_config(**overrides: Any) -> Any:
    args = [
        "backend.rollout=vllm",
        "backend.model_path=/nonexistent/checkpoint",
        *(f"{k}={v}" for k, v in overrides.items()),
    ]
    return load_config(None, args)


def test_a_checkpoint_is_required() -> None:
    config = load_config(None, ["backend.rollout=vllm"])
    with pytest.raises(ConfigError, match=r"set backend\.model_path"):
        LocalBackend.from_config(config)


def test_pinned_episodes_cannot_overlap_training() -> None:
    config = vllm_config(**{"coordinator.weight_update": "pin", "coordinator.pipeline_depth": 1})
    with pytest.raises(ConfigError, match=r"weight_update: latest.*pipeline_depth: 0"):
        LocalBackend.from_config(config)


def test_pinned_episodes_cannot_span_the_mini_batches_of_a_step() -> None:
    config = vllm_config(**{"mode": "sync", "train.mini_batches": 2, "train.groups_per_step": 4})
    assert config.coordinator.weight_update == "pin"
    with pytest.raises(ConfigError, match=r"train.mini_batches \(2\).*mini_batches: 1"):
        LocalBackend.from_config(config)


def test_evaluations_during_training_are_refused() -> None:
    config = vllm_config(**{"eval.every_steps": 5, "coordinator.weight_update": "latest"})
    with pytest.raises(ConfigError, match=r"eval.every_steps 5.*eval.every_steps: 0.*eval.at_end"):
        LocalBackend.from_config(config)
