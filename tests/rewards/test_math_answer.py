"""`math_reward`: the math-verify answer check, right and wrong answers, malformed replies, and
hostile answers that are never run and time out."""

from __future__ import annotations

import importlib.util
import time

import pytest

from rllm_async.rewards import math_answer


@pytest.fixture(scope="module")
def warm() -> None:
    """Start the checking process once, so that its start-up is not timed."""
    if importlib.util.find_spec("math_verify") is None:
        pytest.skip("the `math` extra (part of dev): pip install 'rllm-async[math]'")
    assert math_answer.math_reward({"answer": "1"}, "\\boxed{1}") == (1.0, True)


@pytest.mark.parametrize(
    ("answer", "reply", "expected"),
    [
        ("72", "so the answer is \\boxed{72}.", (1.0, True)),
        ("He sold 48/2 = 24 clips.\n#### 72", "24 + 48 = 72\n#### 72", (1.0, True)),
        ("1,234", "#### $1,234", (1.0, True)),
        ("\\frac{1}{2}", "\\boxed{0.5}", (1.0, True)),
        ("x^2+1", "\\boxed{1 + x^{2}}", (1.0, True)),
        ("72", "\\boxed{71}", (0.0, False)),
        ("#### 72", "#### 27", (0.0, False)),
    ],
)
def test_math_reward_right_and_wrong(warm, answer: str, reply: str, expected: tuple) -> None:
    assert math_answer.math_reward({"answer": answer}, reply) == expected


@pytest.mark.parametrize(
    "reply", ["no final answer", "\\boxed{72", "\\boxed{}", "#### ", "\\boxed{)(}"]
)
def test_math_reward_malformed(warm, reply: str) -> None:
    assert math_answer.math_reward({"answer": "72"}, reply) == (0.0, False)


def test_math_reward_hostile_answers_are_never_run_and_time_out(
    warm, tmp_path, monkeypatch
) -> None:
    marker = tmp_path / "ran"
    code = f"__import__('os').system('touch {marker}')"
    assert math_answer.math_reward({"answer": "72"}, f"\\boxed{{{code}}}") == (0.0, False)
    assert math_answer.math_reward({"answer": "72"}, f"#### {code}") == (0.0, False)
    assert not marker.exists()
    assert math_answer.math_reward(
        {"answer": "72"}, "\\boxed{" + "{" * 3000 + "}" * 3000 + "}"
    ) == (0.0, False)
    monkeypatch.setattr(math_answer, "TIMEOUT_S", 1.0)
    start = time.monotonic()
    assert math_answer.math_reward({"answer": "72"}, "\\boxed{9^{9^{9^{9}}}}") == (0.0, False)
    assert time.monotonic() - start < 3.0
    monkeypatch.setattr(math_answer, "TIMEOUT_S", 30.0)  # a fresh worker starts after the kill
    assert math_answer.math_reward({"answer": "72"}, "\\boxed{72}") == (1.0, True)
    with pytest.raises(KeyError, match=r"data\.<split>\.columns"):
        math_answer.math_reward({"id": "t"}, "\\boxed{1}")
