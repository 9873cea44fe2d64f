"""LoRA adapters alone learn: async GRPO that trains adapters only on the `tiny` preset raises a
reward that rewards answering in digits."""

from __future__ import annotations

from pathlib import Path

from tests.digits import adapters_only_run, mean_reward


def test_reward_rises_when_only_adapters_train(tmp_path: Path) -> None:
    """Async GRPO with adapters only, after a warm start that answers in digits or in letters
    half the time: the adapters learn to answer in digits. (The `tiny` preset's initial
    embeddings are too small for adapters alone to move its output much.)"""
    records = adapters_only_run(tmp_path)
    start, end = mean_reward(records[:1]), mean_reward(records[-5:])  # step 1 samples the base
    # A mixed start: its share of digits moves with the CPU's float kernels (0.295 on an AMD EPYC).
    assert 0.2 < start < 0.8
    assert end > 0.9, (start, end)
